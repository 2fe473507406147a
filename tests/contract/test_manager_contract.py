"""One contract, every manager: a state machine with shadow KV over all 18 combinations of
{one group, hybrid groups} x {no tiers, host tier, host + storage} x {mixed, prefill, decode},
each built by ``manager_for_role``.

Rules drive the uniform API as an engine does: admissions (through a paired prefill node's handoff on a
decode node), plans run per group with failed copies, storage loads (sometimes waited for), forward passes that
write each group's KV, growth, preemption, frees, handoffs and refused calls. After every rule:
``check_integrity`` passes and every admitted, ready sequence's held blocks below its computed line hold exactly
their prefix's KV for their group (see engine.py); blocks handed off stay intact until ``transfer_done``; and a
call the contract refuses raises a ``KVBlocksError`` and changes nothing observable.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvblocks.disagg import PrefillHandoff
from kvblocks.errors import KVBlocksError

from .engine import COMBINATIONS, GARBAGE, HYBRIDS, PEER, ROLES, B, Node, build, build_peer, peer_kind

BASES = (
    [1000 + i for i in range(48)],
    [1000 + i for i in range(10)] + [2000 + i for i in range(38)],  # shares base 0's first two blocks
    [3000 + i for i in range(48)],
)
LENGTHS = [3, 5, 9, 12, 17, 22, 26]
MAX_SEQS = 4
GHOST = "ghost"  # a sequence no manager ever saw

SETTINGS = settings(
    max_examples=16,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same examples on every run: the file's run time is stable
)


class ManagerContract(RuleBasedStateMachine):
    """The generic machine; a subclass per combination sets HYBRID, TIER and ROLE."""

    HYBRID = False
    TIER = "none"
    ROLE = "mixed"

    def __init__(self) -> None:
        super().__init__()
        self.node = Node(build(self.HYBRID, self.TIER, self.ROLE))
        self.m = self.node.m
        self.peer = Node(build_peer(self.HYBRID)) if self.ROLE == "decode" else None
        self.tokens: dict[int, list[int]] = {}  # sequences registered on the node
        self.freed: set[int] = set()
        self.handoffs: dict[int, PrefillHandoff] = {}  # prefill role: handed off, transfer not done
        self.plan: object = None  # a plan taken and still in flight
        self.next_id = 0
        self.closed = False

    def teardown(self) -> None:
        self.node.close()

    # ---------------------------------------------------------------- helpers

    def _live(self, *, ready: bool) -> list[int]:
        m = self.m
        return sorted(
            s
            for s in self.tokens
            if m.is_admitted(s) and s not in self.handoffs and (self.node.ready(s) or not ready)  # type: ignore[attr-defined]
        )

    def _failing(self, data: st.DataObject):  # type: ignore[no-untyped-def]
        def failing(g: int, way: str, targets: tuple[int, ...]) -> set[int]:
            if not targets or data.draw(st.integers(0, 5), label=f"fail {way} {g}?"):
                return set()
            return data.draw(st.sets(st.sampled_from(targets), min_size=1), label=f"failed {way} {g}")

        return failing

    def _admit(self, seq: int, lookahead: int = 0) -> None:
        m = self.m
        self.node.quiesce()  # the storage probe of add_sequence (and writes in flight) answered
        cached = m.lookup(seq)  # type: ignore[attr-defined]
        length = len(self.tokens[seq])
        table = m.allocate(  # type: ignore[attr-defined]
            seq, length - cached.total, num_lookahead_tokens=lookahead, num_cached_tokens=cached.total
        )
        if table is not None:
            assert m.is_admitted(seq)  # type: ignore[attr-defined]
            assert len(m.block_tables(seq)) == self.node.groups  # type: ignore[attr-defined]

    def _refused(self, call, seqs: list[int] | None = None) -> None:  # type: ignore[no-untyped-def]
        """``call`` must raise a kvblocks error and leave every observable figure as it was."""
        seqs = sorted(self.tokens) if seqs is None else seqs
        before = self.node.snapshot(seqs)
        with pytest.raises(KVBlocksError):
            call()
        assert self.node.snapshot(seqs) == before

    def _complete(self, data: st.DataObject) -> None:
        plan, self.plan = self.plan, None
        if plan and data.draw(st.integers(0, 3), label="bad completion?") == 0:
            lacking = self.node.groups
            target = [
                lambda: self.m.complete_transfers(plan, failed_swap_ins={0: {10_000}}),  # type: ignore[attr-defined]
                lambda: self.m.complete_transfers(plan, failed_swap_outs={lacking - 1: {10_000}}),  # type: ignore[attr-defined]
                lambda: self.m.complete_transfers(plan, failed_swap_ins={lacking: set()}),  # type: ignore[attr-defined]
                lambda: self.m.complete_transfers(plan, saved={lacking: []}),  # type: ignore[attr-defined]
            ]
            self._refused(data.draw(st.sampled_from(target), label="bad completion"))
        self.node.run_plan(plan, self._failing(data))

    # ---------------------------------------------------------------- arrivals

    @precondition(lambda self: len(self.tokens) < MAX_SEQS)
    @rule(base=st.integers(0, 2), length=st.sampled_from(LENGTHS), lookahead=st.integers(0, 1), data=st.data())
    def arrive(self, base: int, length: int, lookahead: int, data: st.DataObject) -> None:
        self._arrive(base, length, lookahead, data)

    @precondition(lambda self: len(self.tokens) < MAX_SEQS)
    @rule(base=st.integers(0, 2), length=st.sampled_from(LENGTHS), data=st.data())
    def serve(self, base: int, length: int, data: st.DataObject) -> None:
        """A whole request: it arrives, runs up to three steps, and leaves if it finished (churning the caches)."""
        seq = self._arrive(base, length, 0, data)
        if seq is None:
            return
        for _ in range(3):
            if not self.m.is_admitted(seq):  # type: ignore[attr-defined]
                return
            self.step(data, 1, False)
        m = self.m
        if seq in self._live(ready=True) and m.num_computed_tokens(seq) == len(self.tokens[seq]):  # type: ignore[attr-defined]
            if self.ROLE == "prefill":
                self._finish(seq)
                self._transfer_done(seq)
            else:
                m.free(seq)  # type: ignore[attr-defined]
                del self.tokens[seq]
                self.freed.add(seq)

    def _arrive(self, base: int, length: int, lookahead: int, data: st.DataObject) -> int | None:
        seq = self.next_id
        self.next_id += 1
        tokens = BASES[base][:length]
        if self.ROLE != "decode":
            self.tokens[seq] = list(tokens)
            self.m.add_sequence(seq, tokens)  # type: ignore[attr-defined]
            self._admit(seq, lookahead)
            return seq
        # a decode node: the prompt is prefilled on the paired prefill node and handed off
        peer = self.peer
        assert peer is not None
        p = peer.m
        p.add_sequence(seq, tokens)  # type: ignore[attr-defined]
        cached = p.lookup(seq)  # type: ignore[attr-defined]
        if p.allocate(seq, length - cached.total, num_cached_tokens=cached.total) is None:  # type: ignore[attr-defined]
            p.free(seq)  # type: ignore[attr-defined]
            return None
        peer.check_sequence(seq)  # the prefill node's own hits hold their KV
        peer.compute(seq, length)
        handoff = PrefillHandoff.from_bytes(p.finish_prefill(seq).to_bytes())  # type: ignore[attr-defined]
        if length >= 2 * B and data.draw(st.booleans(), label="wrong prompt first?"):
            wrong = list(tokens)
            wrong[B] += 1
            self._refused(lambda: self.m.accept_handoff(handoff, wrong))  # type: ignore[attr-defined]
        admission = self.m.accept_handoff(handoff, tokens)  # type: ignore[attr-defined]
        if admission is None:
            p.transfer_done(seq)  # type: ignore[attr-defined]
            return None
        self.tokens[seq] = list(tokens)
        assert len(admission.group_transfers) == self.node.groups
        if self.node.tiered:  # the new blocks' evicted content is copied out before the KV lands in them
            if self.plan is not None:
                self._complete(data)
            self.node.run_plan(self.m.take_transfers(), self._failing(data))  # type: ignore[attr-defined]
        ok = data.draw(st.integers(0, 5), label="transfer ok?") > 0
        for g, pairs in enumerate(admission.group_transfers):
            for source, target in pairs:
                self.node.device[g][target] = peer.read(g, source) if ok else GARBAGE
        self.m.receive_done(seq, ok=ok)  # type: ignore[attr-defined]
        p.transfer_done(seq)  # type: ignore[attr-defined]
        if not ok:
            del self.tokens[seq]
            self.freed.add(seq)
            return None
        assert self.m.num_computed_tokens(seq) == length  # type: ignore[attr-defined]
        return seq

    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        waiting = sorted(s for s in self.tokens if not self.m.is_admitted(s))  # type: ignore[attr-defined]
        if waiting:
            self._admit(data.draw(st.sampled_from(waiting)))

    # ---------------------------------------------------------------- one engine step

    @rule(data=st.data(), in_flight=st.integers(0, 3), grow=st.booleans())
    def step(self, data: st.DataObject, in_flight: int, grow: bool) -> None:
        """Schedule (allocate what a cut-back sequence lacks), run the plan, apply loads, forward, commit."""
        m, node = self.m, self.node
        for seq in self._live(ready=True):  # a copy that failed or a load that fell short: the rest is computed
            missing = len(self.tokens[seq]) - m.num_allocated_tokens(seq)  # type: ignore[attr-defined]
            if missing > 0:
                m.allocate(seq, missing)  # type: ignore[attr-defined]
        if node.tiered:
            if self.plan is not None:
                self._complete(data)
            self.plan = m.take_transfers()  # type: ignore[attr-defined]
            if in_flight == 0:
                return  # in flight while the next scheduling calls come; nothing is computed meanwhile
            self._complete(data)
            node.poll()
        for seq in self._live(ready=True):
            length = len(self.tokens[seq])
            done = m.num_computed_tokens(seq)  # type: ignore[attr-defined]
            top = min(length, m.num_allocated_tokens(seq))  # type: ignore[attr-defined]
            if top > done:
                n = top if data.draw(st.integers(0, 2), label="whole?") else data.draw(st.integers(done + 1, top))
                node.compute(seq, n)
            elif grow and done == length and data.draw(st.booleans(), label="grow?"):
                token = 5000 + 100 * seq + length
                if data.draw(st.booleans(), label="via step?"):
                    if m.step([seq], [done], [[token]]) == []:  # type: ignore[attr-defined]
                        self.tokens[seq].append(token)  # a sequence that got no slot is left as it was
                else:
                    m.append_tokens(seq, [token])  # type: ignore[attr-defined]
                    self.tokens[seq].append(token)
                    m.allocate(seq, 1)  # type: ignore[attr-defined]
                assert m.num_tokens(seq) == len(self.tokens[seq])  # type: ignore[attr-defined]

    @precondition(lambda self: self.TIER in ("storage", PEER))
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        """Let queued writes and reads finish, then step until every admitted sequence's copies settled."""
        m, node = self.m, self.node
        deadline = time.monotonic() + 3
        while True:
            if self.plan is not None:
                self._complete(data)
            self.plan = m.take_transfers()  # type: ignore[attr-defined]
            self._complete(data)
            node.poll()
            if all(node.ready(s) for s in self._live(ready=False)):
                return
            assert time.monotonic() < deadline, "copies never settled"
            time.sleep(0.001)

    # ---------------------------------------------------------------- leaving

    @rule(data=st.data(), preempt=st.booleans())
    def leave(self, data: st.DataObject, preempt: bool) -> None:
        seqs = self._live(ready=False)
        if not seqs:
            return
        seq = data.draw(st.sampled_from(seqs))
        if preempt:
            self.m.preempt(seq)  # type: ignore[attr-defined]
            assert not self.m.is_admitted(seq)  # type: ignore[attr-defined]
        else:
            self.m.free(seq)  # type: ignore[attr-defined]
            del self.tokens[seq]
            self.freed.add(seq)

    @precondition(lambda self: self.ROLE == "prefill")
    @rule(data=st.data())
    def finish_prefill(self, data: st.DataObject) -> None:
        m = self.m
        done = [s for s in self._live(ready=True) if m.num_computed_tokens(s) == len(self.tokens[s])]  # type: ignore[attr-defined]
        if not done:
            return
        self._finish(data.draw(st.sampled_from(done)))

    def _finish(self, seq: int) -> None:
        m = self.m
        handoff = m.finish_prefill(seq)  # type: ignore[attr-defined]
        assert handoff.block_hashes == tuple(m.block_hashes(seq))  # type: ignore[attr-defined]
        covered = -(-len(self.tokens[seq]) // B)  # the prompt's blocks (lookahead slots are not handed off)
        assert [list(b) for b in handoff.group_blocks] == [t[:covered] for t in m.block_tables(seq)]  # type: ignore[attr-defined]
        self.handoffs[seq] = handoff
        self._refused(lambda: m.free(seq))  # type: ignore[attr-defined]  # held until transfer_done

    @precondition(lambda self: self.ROLE == "prefill")
    @rule(data=st.data())
    def transfer_done(self, data: st.DataObject) -> None:
        if not self.handoffs:
            return
        self._transfer_done(data.draw(st.sampled_from(sorted(self.handoffs))))

    def _transfer_done(self, seq: int) -> None:
        del self.handoffs[seq]
        self.m.transfer_done(seq)  # type: ignore[attr-defined]
        del self.tokens[seq]
        self.freed.add(seq)

    # ---------------------------------------------------------------- refused calls

    @rule(data=st.data())
    def bad_input(self, data: st.DataObject) -> None:
        m = self.m
        calls = [
            lambda: m.allocate(GHOST, 1),  # type: ignore[attr-defined]
            lambda: m.commit(GHOST, B),  # type: ignore[attr-defined]
            lambda: m.free(GHOST),  # type: ignore[attr-defined]
            lambda: m.preempt(GHOST),  # type: ignore[attr-defined]
            lambda: m.lookup(GHOST),  # type: ignore[attr-defined]
            lambda: m.block_tables(GHOST),  # type: ignore[attr-defined]
            lambda: m.append_tokens(GHOST, [1]),  # type: ignore[attr-defined]
        ]
        if self.tokens:
            seq = data.draw(st.sampled_from(sorted(self.tokens)), label="seq")
            beyond = len(self.tokens[seq]) + B
            calls.append(lambda: m.commit(seq, beyond))  # type: ignore[attr-defined]
            calls.append(lambda: m.add_sequence(seq, [1, 2, 3]))  # type: ignore[attr-defined]
        if self.freed:
            gone = data.draw(st.sampled_from(sorted(self.freed)), label="freed")
            calls.append(lambda: m.allocate(gone, 1))  # type: ignore[attr-defined]
            calls.append(lambda: m.free(gone))  # type: ignore[attr-defined]
        if self.ROLE == "prefill":
            calls.append(lambda: m.transfer_done(GHOST))  # type: ignore[attr-defined]
            calls.append(lambda: m.finish_prefill(GHOST))  # type: ignore[attr-defined]
            idle = [s for s in self.tokens if s not in self.handoffs]
            if idle:
                calls.append(lambda: m.transfer_done(idle[0]))  # type: ignore[attr-defined]
        if self.ROLE == "decode":
            calls.append(lambda: m.receive_done(GHOST))  # type: ignore[attr-defined]
        self._refused(data.draw(st.sampled_from(calls), label="bad call"))

    # ---------------------------------------------------------------- invariants

    @invariant()
    def contract(self) -> None:
        m = self.m
        m.check_integrity()  # type: ignore[attr-defined]
        for seq in self._live(ready=True):
            self.node.check_sequence(seq)
        for seq, handoff in self.handoffs.items():  # handed-off blocks are not reused before transfer_done
            self.node.check_blocks(handoff.group_blocks, handoff.block_hashes, seq)
        if self.peer is not None:
            self.peer.m.check_integrity()  # type: ignore[attr-defined]


def machine_for(hybrid: bool, tier: str, role: str) -> type[ManagerContract]:
    name = f"Contract_{'hybrid' if hybrid else 'single'}_{tier}_{role}"
    return type(name, (ManagerContract,), {"HYBRID": hybrid, "TIER": tier, "ROLE": role})


@pytest.mark.parametrize(
    ("hybrid", "tier", "role"),
    COMBINATIONS,
    ids=[f"{'hybrid' if h else 'single'}-{t}-{r}" for h, t, r in COMBINATIONS],
)
def test_manager_contract(hybrid: bool, tier: str, role: str) -> None:
    run_state_machine_as_test(machine_for(hybrid, tier, role), settings=SETTINGS)


PEERED = [(hybrid, PEER, role) for hybrid in HYBRIDS for role in ROLES]


@pytest.mark.parametrize(
    ("hybrid", "tier", "role"), PEERED, ids=[f"{'hybrid' if h else 'single'}-{t}-{r}" for h, t, r in PEERED]
)
def test_manager_contract_over_a_tier_registered_from_test_code(hybrid: bool, tier: str, role: str) -> None:
    """The same machine with a host tier above a keyed tier no module of kvblocks knows: the tier protocol
    carries every rule the built-in storage tier is held to."""
    with peer_kind():
        run_state_machine_as_test(machine_for(hybrid, tier, role), settings=SETTINGS)


TIERED = [c for c in COMBINATIONS if c[1] != "none"]


@pytest.mark.parametrize(
    ("hybrid", "tier", "role"), TIERED, ids=[f"{'hybrid' if h else 'single'}-{t}-{r}" for h, t, r in TIERED]
)
def test_an_empty_plan_refuses_failures_it_does_not_hold(hybrid: bool, tier: str, role: str) -> None:
    node = Node(build(hybrid, tier, role))
    try:
        plan = node.m.take_transfers()  # type: ignore[attr-defined]
        assert not plan  # nothing was scheduled: an empty plan
        with pytest.raises(KVBlocksError):
            node.m.complete_transfers(plan, failed_swap_ins={0: {10_000}})  # type: ignore[attr-defined]
        with pytest.raises(KVBlocksError):
            node.m.complete_transfers(plan, failed_swap_outs={0: {10_000}})  # type: ignore[attr-defined]
        node.m.complete_transfers(plan)  # type: ignore[attr-defined]  # the plan itself completes
    finally:
        node.close()
