"""The vLLM connector's scheduler side (kvblocks.integrations.vllm.planner), without vLLM."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.integrations.vllm.planner import BlockRun, Scheduled, StepPlan, TransferPlanner
from tests.support.vllm_planner import FakeIndex, chain

BS = 4


def step(planner: TransferPlanner, *requests: Scheduled, **hashes: Sequence[bytes]) -> StepPlan:
    """One step of ``requests`` (``hashes`` introduces requests the planner never matched, by id)."""
    return planner.plan_step(requests, hashes=hashes)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_match_is_the_leading_run_the_index_knows_past_the_local_hit() -> None:
    h = chain(6)
    index = FakeIndex(known={h[1], h[2], h[4]}, stored={h[1], h[2], h[4]})
    planner = TransferPlanner(index, BS)
    assert planner.match("a", h, 22, 4) is None  # block 3 is unknown: the store is asked first
    index.answer_all()
    # block 0 is a local hit; 1 and 2 are stored; 3 is not, so 4 does not count
    assert planner.match("a", h, 22, 4) == 2 * BS


def test_the_last_token_is_always_computed() -> None:
    h = chain(4)
    planner = TransferPlanner(FakeIndex(known=set(h), stored=set(h)), BS)
    assert planner.match("exact", h, 16, 0) == 3 * BS  # 16 tokens: at most 15 loadable, 3 whole blocks
    assert planner.match("one-more", h, 17, 0) == 4 * BS


def test_an_unknown_block_is_probed_and_asked_again_until_answered() -> None:
    h = chain(5)
    index = FakeIndex(stored=set(h))
    planner = TransferPlanner(index, BS)
    assert planner.match("a", h, 21, 0) is None
    assert planner.match("a", h, 21, 0) is None  # one probe: still out
    assert len(index.pending) == 1 and index.pending[0] == tuple(h)
    index.answer_all()
    assert planner.match("a", h, 21, 0) == 5 * BS


def test_a_probe_past_its_deadline_answers_with_what_is_known() -> None:
    h = chain(5)
    clock = Clock()
    index = FakeIndex(stored=set(h), known={h[0]})
    planner = TransferPlanner(index, BS, lookup_timeout_s=0.5, clock=clock)
    assert planner.match("a", h, 21, 0) is None
    clock.now = 0.6
    assert planner.match("a", h, 21, 0) == 1 * BS


def test_a_full_probe_queue_answers_at_once() -> None:
    h = chain(3)
    planner = TransferPlanner(FakeIndex(stored=set(h), known={h[0]}, probe_room=0), BS)
    assert planner.match("a", h, 13, 0) == 1 * BS


def test_allocated_blocks_become_one_load_of_exact_ids() -> None:
    h = chain(6)
    index = FakeIndex(known=set(h[:5]), stored=set(h[:5]))
    planner = TransferPlanner(index, BS)
    assert planner.match("a", h, 24, 4) == 4 * BS
    planner.allocated("a", [7, 3, 9, 11, 2, 5], 4 * BS)
    plan = step(planner, Scheduled("a", 20, 4, block_ids=[7, 3, 9, 11, 2, 5]))
    assert plan.loads == (BlockRun("a", tuple(h[1:5]), (3, 9, 11, 2)),) and plan.failed == ()
    # the loaded blocks are not saved again; block 5 is, once the step fills it -- computed over this step's
    # loads, whose outcome the scheduler does not know yet: they are its guard (block 7 is a local hit)
    roots = frozenset({(plan.step, 0, 4)})  # all four blocks of the step's first load run must arrive
    assert plan.saves == (BlockRun("a", (h[5],), (5,), (roots,)),)
    assert step(planner).loads == ()


def test_allocation_without_a_match_in_whole_blocks_is_refused() -> None:
    h = chain(3)
    planner = TransferPlanner(FakeIndex(known=set(h), stored=set(h)), BS)
    assert planner.match("a", h, 13, 0) == 3 * BS
    with pytest.raises(InvalidArgumentError):
        planner.allocated("a", [0, 1, 2], 5)
    with pytest.raises(InvalidArgumentError):
        planner.allocated("a", [0, 1], 3 * BS)  # fewer blocks than the match
    assert step(planner).loads == ()


def test_saves_are_whole_real_blocks_each_once_and_never_known_ones() -> None:
    h = chain(4)
    index = FakeIndex(known={h[1]})
    planner = TransferPlanner(index, BS)
    assert step(planner, Scheduled("a", 0, 6, block_ids=[10, 11]), a=h[:1]).saves == (BlockRun("a", (h[0],), (10,)),)
    # 6 -> 14 tokens: blocks 1, 2 full (1 is known stored); block 3 needs 16 tokens
    plan = step(planner, Scheduled("a", 6, 8, new_block_ids=[12, 13]), a=h)
    assert plan.saves == ()  # the planner kept the first hashes list it was given: only one hash known
    planner = TransferPlanner(index, BS)
    plan = step(planner, Scheduled("b", 0, 14, block_ids=[10, 11, 12, 13]), b=h)
    assert plan.saves == (BlockRun("b", (h[0], h[2]), (10, 12)),)
    assert step(planner, Scheduled("b", 14, 1)).saves == ()  # 15 tokens: block 3 not full yet
    assert step(planner, Scheduled("b", 15, 1)).saves == (BlockRun("b", (h[3],), (13,)),)
    assert step(planner, Scheduled("b", 16, 1)).saves == ()
    # drafts are computed but may be rejected: a block they would fill is not saved until real tokens fill it
    planner = TransferPlanner(FakeIndex(), BS)
    assert step(planner, Scheduled("c", 0, 6, 3, block_ids=[1, 2]), c=h).saves == ()
    assert step(planner, Scheduled("c", 3, 2)).saves == (BlockRun("c", (h[0],), (1,)),)


def test_requests_sharing_a_prefix_in_one_step_save_its_blocks_once() -> None:
    h = chain(3)
    planner = TransferPlanner(FakeIndex(), BS)
    plan = step(
        planner,
        Scheduled("a", 0, 12, block_ids=[0, 1, 2]),
        Scheduled("b", 0, 12, block_ids=[0, 1, 5]),
        a=h,
        b=h[:2] + [b"other"],
    )
    assert plan.saves == (BlockRun("a", tuple(h), (0, 1, 2)), BlockRun("b", (b"other",), (5,)))
    forgetful = TransferPlanner(FakeIndex(), BS, recent_saves=1)  # remembers only the last planned save
    step(forgetful, Scheduled("a", 0, 12, block_ids=[0, 1, 2]), a=h)
    assert step(forgetful, Scheduled("b", 0, 12, block_ids=[3, 4, 5]), b=h).saves == (
        BlockRun("b", tuple(h[:2]), (3, 4)),
    )


def test_a_failed_load_is_forgotten_and_its_recomputed_blocks_saved_again() -> None:
    h = chain(5)
    index = FakeIndex(known=set(h), stored=set(h))
    planner = TransferPlanner(index, BS)
    assert planner.match("a", h, 20, 0) == 4 * BS
    planner.allocated("a", [10, 11, 12, 13, 14], 4 * BS)
    plan = step(planner, Scheduled("a", 16, 4, block_ids=[10, 11, 12, 13, 14]))
    (run,) = plan.loads
    assert run.block_ids == (10, 11, 12, 13) and plan.saves == ()  # block 4 is known stored
    # the workers loaded blocks 10 and 11; 12 was corrupt, so vLLM recomputes 12 and 13 (from the first failure)
    assert planner.load_failed({12, 13, 99}) == 2  # 99 is no load of this planner's
    assert index.known == {h[0], h[1], h[4]}
    planner.confirm({plan.step: {12, 13}})
    assert planner.provenance.is_bad(12) and planner.provenance.is_bad(13) and not planner.provenance.is_bad(10)
    # vLLM rewinds a to block 2 and recomputes it over 10 and 11, which loaded sound: saved, unguarded
    assert step(planner, Scheduled("a", 8, 12)).saves == (BlockRun("a", (h[2], h[3]), (12, 13)),)
    assert planner.provenance.clean
    assert planner.load_failed({12}) == 0  # reported once


def test_a_preempted_request_saves_into_its_new_table_and_not_twice() -> None:
    h = chain(3)
    planner = TransferPlanner(FakeIndex(), BS)
    assert step(planner, Scheduled("a", 0, 4, block_ids=[1, 2, 3]), a=h).saves == (BlockRun("a", (h[0],), (1,)),)
    planner.plan_step((), preempted=["a"])
    assert step(planner, Scheduled("a", 0, 12, block_ids=[7, 8, 9])).saves == (BlockRun("a", (h[1], h[2]), (8, 9)),)


def test_a_finished_request_is_forgotten_with_its_unsent_loads() -> None:
    h = chain(3)
    planner = TransferPlanner(FakeIndex(known=set(h), stored=set(h)), BS)
    assert planner.match("a", h, 13, 0) == 3 * BS
    planner.allocated("a", [4, 5, 6], 3 * BS)
    planner.finished("a")
    assert step(planner).loads == () and len(planner) == 0
    assert step(planner, Scheduled("a", 0, 12, block_ids=[4, 5, 6])).saves == () and len(planner) == 0


def test_bad_configuration_is_refused() -> None:
    for size in (0, -1, True, 2.0):
        with pytest.raises(ConfigError):
            TransferPlanner(FakeIndex(), size)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        TransferPlanner(FakeIndex(), 4, lookup_timeout_s=-1)
    with pytest.raises(InvalidArgumentError):
        TransferPlanner(FakeIndex(), 4).match("a", chain(2), 9, 3)


class PlannerMachine(RuleBasedStateMachine):
    """Requests over shared prefixes, a store that is not prefix-closed, probes answered late, steps.

    Invariants checked against brute force: a match is the leading run the index knows (capped so the
    last token is computed); a load maps each hash to the block at its position; every block position
    of a request is saved at most once, from the table it had, and a hash known stored is never saved.
    """

    @initialize(stored=st.sets(st.integers(0, 11)), known_share=st.integers(0, 3))
    def setup(self, stored: set[int], known_share: int) -> None:
        self.hashes = chain(12, "p")  # one shared chain: requests are prefixes of it
        stored_hashes = {self.hashes[i] for i in stored}
        known = {h for i, h in enumerate(self.hashes) if h in stored_hashes and i % 4 < known_share}
        self.index = FakeIndex(stored=stored_hashes, known=known)
        self.planner = TransferPlanner(self.index, BS)
        self.requests: dict[str, dict] = {}
        self.saved: set[tuple[str, int]] = set()
        self.next_block = 0

    @rule(length=st.integers(1, 48), computed_blocks=st.integers(0, 12))
    def match(self, length: int, computed_blocks: int) -> None:
        rid = f"r{self.next_block}"  # never reused
        computed = min(computed_blocks, length // BS) * BS
        hashes = self.hashes[: length // BS]
        got = self.planner.match(rid, hashes, length, computed)
        if got is None:
            self.index.answer_all()
            got = self.planner.match(rid, hashes, length, computed)
        limit = min(len(hashes), (length - 1) // BS)
        expected = 0
        for h in hashes[computed // BS : limit]:
            if h not in self.index.known:
                break
            expected += 1
        assert got == expected * BS
        table = list(range(self.next_block, self.next_block + len(hashes) + 1))
        self.next_block += len(table)
        self.planner.allocated(rid, table, got)
        for run in step(self.planner).loads:
            assert run.request_id == rid
            first = computed // BS
            assert run.hashes == tuple(hashes[first : first + len(run.hashes)])
            assert run.block_ids == tuple(table[first : first + len(run.hashes)])
        self.requests[rid] = {"hashes": hashes, "table": table, "done": computed + got, "length": length}

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), tokens=st.integers(1, 20))
    def step(self, data: st.DataObject, tokens: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests[rid]
        table = req["table"] if "scheduled" not in req else None
        req["scheduled"] = True
        plan = step(self.planner, Scheduled(rid, req["done"], tokens, block_ids=table))
        self.planner.confirm({s: () for s in range(1, plan.step + 1)})  # every load landed sound
        req["done"] += tokens
        for run in plan.saves:
            for h, b in zip(run.hashes, run.block_ids, strict=True):
                position = self.hashes.index(h)
                assert position < min(len(req["hashes"]), req["done"] // BS)
                assert b == req["table"][position]
                assert (rid, position) not in self.saved
                assert h not in self.index.known
                self.saved.add((rid, position))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.planner.finished(rid)
        del self.requests[rid]

    @invariant()
    def tracks_only_live_requests(self) -> None:
        if hasattr(self, "planner"):
            assert len(self.planner) == len(self.requests)


PlannerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=25, deadline=None)
test_planner_machine = PlannerMachine.TestCase
