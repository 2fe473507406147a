"""The connector's scheduler side for hybrid models (vLLM's HMA): hits every group serves, per-group loads of
only what each group's rule needs, per-group saves, and per-request load outcomes. No vLLM needed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvblocks.core.groups.hits import GroupHitRule
from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.integrations.vllm.hybrid_planner import NULL_BLOCK, HybridPlanner
from kvblocks.integrations.vllm.planner import Scheduled
from tests.support.vllm_planner import FakeIndex, chain

BS = 4
FULL = GroupHitRule("full", BS)


def window(w: int) -> GroupHitRule:
    return GroupHitRule("sliding_window", BS, w)


def _planner(
    stored: list[set[bytes]], rules: list[GroupHitRule], known: bool = True
) -> tuple[HybridPlanner, list[FakeIndex]]:
    indexes = [FakeIndex(stored=s, known=s if known else set()) for s in stored]
    return HybridPlanner(rules, indexes, BS), indexes


def _settled(planner: HybridPlanner, indexes: list[FakeIndex], *args: object) -> int | None:
    """``planner.match(*args)`` once every probe it sends is answered."""
    got = planner.match(*args)  # type: ignore[arg-type]
    if got is None:
        for index in indexes:
            index.answer_all()
        got = planner.match(*args)  # type: ignore[arg-type]
    return got


def test_the_hit_is_the_largest_every_group_serves_and_each_group_loads_only_what_it_needs() -> None:
    # the module docstring's example, at block size 4 and a window of 8 tokens (a hit needs 2 blocks before it)
    hashes = chain(10)
    full = set(hashes[:7])
    swa = {hashes[i] for i in (0, 1, 4, 5, 6, 7)}
    planner, indexes = _planner([full, swa], [FULL, window(8)])
    assert _settled(planner, indexes, "r", hashes, 38, 0) == 7 * BS  # (38 - 1) // 4 = 9 loadable; full stops at 7
    tables = [list(range(100, 110)), [NULL_BLOCK] * 5 + [205, 206, 207, 208, 209]]
    planner.allocated("r", tables, 7 * BS)
    plan = planner.plan_step([])
    by_group = {run.group: run for run in plan.loads}
    assert by_group[0].block_ids == tuple(range(100, 107)) and by_group[0].hashes == tuple(hashes[:7])
    assert by_group[1].block_ids == (205, 206) and by_group[1].hashes == (hashes[5], hashes[6])  # tokens 21..27


def test_blocks_below_the_local_hit_count_as_cached_for_every_group() -> None:
    hashes = chain(8)
    # nothing stored below block 3 (vLLM's local hit covers blocks 0..2); both groups store 3..5
    stored = set(hashes[3:6])
    planner, indexes = _planner([stored, stored], [FULL, window(8)])
    assert _settled(planner, indexes, "r", hashes, 33, 3 * BS) == 3 * BS  # blocks 3..5: hit at 24 tokens


def test_a_window_group_missing_its_last_blocks_lowers_the_hit_below_them() -> None:
    hashes = chain(10)
    planner, indexes = _planner([set(hashes), set(hashes[:5])], [FULL, window(8)])
    # a hit at h needs window blocks (h - 7) // 4 .. h // 4 - 1: the highest served is 20 (blocks 3, 4)
    assert _settled(planner, indexes, "r", hashes, 41, 0) == 20


def test_an_unknown_block_is_probed_in_every_group_that_lacks_it_and_answered_later() -> None:
    hashes = chain(6)
    planner, indexes = _planner([set(hashes), set(hashes)], [FULL, window(8)], known=False)
    assert planner.match("r", hashes, 25, 0) is None
    assert all(index.pending for index in indexes)
    indexes[0].answer_all()
    assert planner.match("r", hashes, 25, 0) is None  # group 1's probe is still out
    indexes[1].answer_all()
    assert planner.match("r", hashes, 25, 0) == 24


def test_a_probe_past_its_deadline_answers_with_what_is_known() -> None:
    hashes = chain(6)
    now = [0.0]
    indexes = [FakeIndex(stored=set(hashes), known=set(hashes)), FakeIndex(stored=set(hashes), known=set(hashes[:2]))]
    planner = HybridPlanner([FULL, window(8)], indexes, BS, lookup_timeout_s=1.0, clock=lambda: now[0])
    assert planner.match("r", hashes, 25, 0) is None
    now[0] = 2.0
    assert planner.match("r", hashes, 25, 0) == 8  # the window group knows blocks 0, 1: a hit at 8 needs 0, 1


def test_a_failed_load_forgets_the_hashes_that_did_not_arrive_and_the_request_is_never_offered_a_hit_again() -> None:
    hashes = chain(6)
    planner, indexes = _planner([set(hashes), set(hashes)], [FULL, window(8)])
    assert planner.match("r", hashes, 25, 0) == 24
    assert planner.match("s", hashes, 25, 0) == 24  # another request on the same prefix
    planner.allocated("r", [list(range(10, 16)), [0, 0, 0, 0, 24, 25]], 24)
    plan = planner.plan_step([])
    assert {run.group for run in plan.loads} == {0, 1}
    # the workers report window block 5 and full blocks 4, 5 lost (a run stops at its first bad block)
    planner.loads_done({"r"}, [(1, hashes[5]), (0, hashes[4]), (0, hashes[5])])
    assert indexes[0].known == set(hashes[:4]) and indexes[1].known == set(hashes[:5])
    indexes[0].known = set(hashes)
    indexes[1].known = set(hashes)
    assert planner.match("r", hashes, 25, 0) == 0
    assert planner.match("s", hashes, 25, 0) == 24  # the sound blocks stay hits for every other request


def test_a_sound_load_keeps_the_index_and_saves_start_past_the_loaded_blocks() -> None:
    hashes = chain(8)
    planner, indexes = _planner([set(hashes[:4]), set(hashes[:4])], [FULL, window(8)])
    assert _settled(planner, indexes, "r", hashes, 30, 0) == 16
    planner.allocated("r", [[1, 2, 3, 4, 5], [0, 0, 13, 14, 15]], 16)
    planner.plan_step([])
    planner.loads_done(set())
    plan = planner.plan_step(
        [Scheduled("r", 16, 14, block_ids=[[1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 13, 14, 15, 16, 17, 18]])]
    )
    saved = {(run.group, h, b) for run in plan.saves for h, b in zip(run.hashes, run.block_ids, strict=True)}
    # 30 tokens fill blocks 0..6; 0..3 are loaded (stored): blocks 4..6 of each group are saved
    assert saved == {
        (g, hashes[p], ids[p])
        for g, ids in enumerate([[1, 2, 3, 4, 5, 6, 7], [0, 0, 13, 14, 15, 16, 17]])
        for p in (4, 5, 6)
    }
    assert indexes[0].known == set(hashes[:4])


def test_a_null_block_where_a_load_goes_is_refused_and_fail_reports_the_request() -> None:
    hashes = chain(6)
    planner, _ = _planner([set(hashes), set(hashes)], [FULL, window(8)])
    assert planner.match("r", hashes, 25, 0) == 24
    with pytest.raises(InvalidArgumentError, match="null block"):
        planner.allocated("r", [list(range(10, 16)), [0, 0, 0, 0, 0, 25]], 24)
    planner.fail("r")
    plan = planner.plan_step([])
    assert plan.loads == () and plan.failed_requests == ("r",)
    assert planner.match("r", hashes, 25, 0) == 0


def test_a_window_group_saves_only_blocks_the_request_certainly_holds_and_never_the_null_block() -> None:
    hashes = chain(12)
    planner, indexes = _planner([set(), set()], [FULL, window(8)])
    assert _settled(planner, indexes, "r", hashes, 48, 0) == 0
    # a new request: its tables come this step (the window group's early blocks already freed: null)
    plan = planner.plan_step([Scheduled("r", 0, 20, block_ids=[[1, 2, 3, 4, 5], [0, 0, 23, 24, 25]])])
    got = {run.group: run.block_ids for run in plan.saves}
    assert got == {0: (1, 2, 3, 4, 5), 1: (23, 24, 25)}
    # the engine saved nothing of blocks 5 and 6 yet (a step that wrote only 3 tokens); then one writes 5..8
    plan = planner.plan_step([Scheduled("r", 20, 3, new_block_ids=[[6], [26]])])
    assert plan.saves == ()
    plan = planner.plan_step([Scheduled("r", 23, 13, new_block_ids=[[7, 8, 9], [27, 28, 29]])])
    got = {run.group: run.block_ids for run in plan.saves}
    # 36 tokens fill blocks 0..8; this step writes from block 5 on (token 23 is in block 5)
    assert got == {0: (6, 7, 8, 9), 1: (26, 27, 28, 29)}


def test_requests_sharing_a_prefix_save_each_group_block_once() -> None:
    shared = chain(4, "s")
    a, b = shared + chain(2, "a"), shared + chain(2, "b")
    planner, indexes = _planner([set(), set()], [FULL, window(8)])
    _settled(planner, indexes, "a", a, 24, 0)
    _settled(planner, indexes, "b", b, 24, 0)
    plan = planner.plan_step(
        [
            Scheduled("a", 0, 24, block_ids=[[1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16]]),
            Scheduled("b", 0, 24, block_ids=[[1, 2, 3, 4, 7, 8], [11, 12, 13, 14, 17, 18]]),
        ]
    )
    pairs = [(run.group, h) for run in plan.saves for h in run.hashes]
    assert len(pairs) == len(set(pairs)) == 2 * 8


def test_salvage_keeps_the_loads_vllm_waits_for() -> None:
    hashes = chain(6)
    planner, _ = _planner([set(hashes), set(hashes)], [FULL, window(8)])
    planner.match("r", hashes, 25, 0)
    planner.allocated("r", [list(range(10, 16)), [0, 0, 0, 0, 24, 25]], 24)
    plan = planner.salvage()
    assert {run.group for run in plan.loads} == {0, 1} and plan.saves == ()


def test_a_finished_request_drops_its_unplanned_loads() -> None:
    hashes = chain(6)
    planner, _ = _planner([set(hashes), set(hashes)], [FULL, window(8)])
    planner.match("r", hashes, 25, 0)
    planner.allocated("r", [list(range(10, 16)), [0, 0, 0, 0, 24, 25]], 24)
    planner.finished("r")
    assert planner.plan_step([]).loads == () and len(planner) == 0


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError):
        HybridPlanner([FULL], [], BS)
    with pytest.raises(ConfigError):
        HybridPlanner([GroupHitRule("full", 8)], [FakeIndex()], BS)
    with pytest.raises(ConfigError):
        HybridPlanner([FULL], [FakeIndex()], 0)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 14),
    w=st.integers(2, 20),
    local=st.integers(0, 14),
    full_stored=st.sets(st.integers(0, 13)),
    swa_stored=st.sets(st.integers(0, 13)),
    extra=st.integers(1, 4),
)
def test_the_hit_is_what_a_brute_force_search_finds(
    n: int, w: int, local: int, full_stored: set[int], swa_stored: set[int], extra: int
) -> None:
    hashes = chain(n)
    num_tokens = n * BS + extra - 1
    local = min(local, (num_tokens - 1) // BS, n)
    planner, indexes = _planner(
        [{hashes[i] for i in full_stored if i < n}, {hashes[i] for i in swa_stored if i < n}], [FULL, window(w)]
    )
    got = _settled(planner, indexes, "r", hashes, num_tokens, local * BS)
    limit = min(n, (num_tokens - 1) // BS)

    def served(h: int) -> bool:
        blocks = h // BS
        full_ok = all(i < local or i in full_stored for i in range(blocks))
        first_token = max(0, h - w + 1)
        swa_ok = all(i < local or i in swa_stored for i in range(first_token // BS, blocks))
        return full_ok and swa_ok

    best = max((h for h in range(local * BS, limit * BS + 1, BS) if served(h)), default=local * BS)
    assert got == best - local * BS


class HybridPlannerMachine(RuleBasedStateMachine):
    """Requests over one store, a full and a window group: whatever the order of steps, no (group, hash) is
    planned for saving twice, no null block is saved, a window group's save names a block its request holds now,
    and every load names a block of its request's table at the position of its hash."""

    @initialize(w=st.integers(2, 12))
    def start(self, w: int) -> None:
        self.stored: list[set[bytes]] = [set(), set()]
        self.indexes = [FakeIndex(), FakeIndex()]
        self.planner = HybridPlanner([FULL, window(w)], self.indexes, BS)
        self.w = w
        self.next_block = 1
        self.running: dict[str, dict] = {}
        self.saved: set[tuple[int, bytes]] = set()
        self.count = 0

    def _ids(self, k: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + k))
        self.next_block += k
        return ids

    @rule(prefix=st.integers(0, 4), length=st.integers(2, 30))
    def arrive(self, prefix: int, length: int) -> None:
        self.count += 1
        rid = f"r{self.count}"
        tokens_blocks = -(-length // BS)
        hashes = chain(prefix, "shared") + chain(max(0, tokens_blocks - prefix), rid)
        got = _settled(self.planner, self.indexes, rid, hashes, length, 0)
        assert got is not None and got % BS == 0 and got <= max(0, length - 1)
        # vLLM's allocation: every full block, the window group's blocks below the window null
        table_full = self._ids(tokens_blocks)
        first_needed = max(0, got - self.w + 1) // BS
        table_swa = [NULL_BLOCK if p < first_needed else b for p, b in enumerate(self._ids(tokens_blocks))]
        self.planner.allocated(rid, [table_full, table_swa], got)
        plan = self.planner.plan_step([])
        for run in plan.loads:
            table = (table_full, table_swa)[run.group]
            for h, b in zip(run.hashes, run.block_ids, strict=True):
                assert b != NULL_BLOCK and table[hashes.index(h)] == b
        self.planner.loads_done(set())
        self.running[rid] = {
            "hashes": hashes,
            "length": length,
            "done": got,
            "tables": [table_full, table_swa],
            "new": True,
        }

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        scheduled = []
        holds: dict[str, tuple[set[int], set[int]]] = {}
        for rid, r in sorted(self.running.items()):
            todo = r["length"] - r["done"]
            if todo <= 0:
                continue
            num = data.draw(st.integers(1, todo))
            if r["new"]:
                scheduled.append(Scheduled(rid, r["done"], num, block_ids=[list(t) for t in r["tables"]]))
                r["new"] = False
            else:
                scheduled.append(Scheduled(rid, r["done"], num, new_block_ids=[[], []]))
            first_held = max(0, r["done"] - self.w + 1) // BS
            holds[rid] = (set(r["tables"][0]), {b for p, b in enumerate(r["tables"][1]) if p >= first_held})
            r["done"] += num
        plan = self.planner.plan_step(scheduled)
        for run in plan.saves:
            for h in run.hashes:
                assert (run.group, h) not in self.saved
                self.saved.add((run.group, h))
                self.stored[run.group].add(h)
            for b in run.block_ids:
                assert b != NULL_BLOCK and b in holds[run.request_id][run.group]
        for index, stored in zip(self.indexes, self.stored, strict=True):
            index.stored |= stored
            index.known |= stored

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        del self.running[rid]
        self.planner.finished(rid)

    @invariant()
    def tracks_only_live_requests(self) -> None:
        if hasattr(self, "planner"):
            assert len(self.planner) <= self.count


TestHybridPlannerMachine = HybridPlannerMachine.TestCase
TestHybridPlannerMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
