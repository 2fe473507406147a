"""HybridKVCacheManager: full-attention layers beside sliding-window and chunked-local groups."""

from __future__ import annotations

import math

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from kvblocks import KVCacheManager, StaleLookupError
from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.events import EventSink
from kvblocks.hybrid import PLACEHOLDER, HybridKVCacheManager, LocalGroup
from kvblocks.hybrid.cross import CrossAttentionGroup
from kvblocks.hybrid.recurrent import RecurrentGroup

B = 2


def hybrid(window: int = 4, chunk: int = 4, blocks: int = 16) -> HybridKVCacheManager:
    return HybridKVCacheManager(
        blocks,
        B,
        local_groups=[LocalGroup("sliding_window", window, blocks), LocalGroup("chunked_local", chunk, blocks)],
    )


def serve(m: KVCacheManager, seq: str, tokens: list[int]) -> None:
    m.add_sequence(seq, tokens)
    seen = m.lookup(seq).total
    assert m.allocate(seq, len(tokens) - seen, num_cached_tokens=seen) is not None
    m.commit(seq, len(tokens))


def test_a_window_group_releases_what_no_later_token_attends_to() -> None:
    m = hybrid(window=4)
    serve(m, "a", list(range(11)))  # next token 11 attends 8..11: window positions 0-3 leave
    assert m.group_block_table("a", 0) == [0, 1, 2, 3, 4, 5]
    assert m.group_block_table("a", 1) == [PLACEHOLDER] * 4 + [4, 5]
    assert m.group_block_table("a", 2) == [PLACEHOLDER] * 4 + [4, 5]  # chunk 2 (tokens 8..11)
    assert m.group_pool(1).num_idle == 4  # released blocks stay cached
    m.check_integrity()


def test_a_hit_needs_only_the_window_in_a_window_group() -> None:
    m = hybrid(window=4, chunk=8)
    serve(m, "a", list(range(13)))
    m.free("a")
    assert m._locals[0].index.evict(2) == [0, 1]  # the window group's oldest: not needed by a hit at 12
    m.add_sequence("b", list(range(13)))
    assert m.lookup("b").device == 12  # full run 6 blocks; window needs tokens 9..11 -> positions 4, 5
    table = m.allocate("b", 1, num_cached_tokens=12)
    assert table is not None and table.num_cached_tokens == 12
    assert m.group_block_table("b", 1)[:4] == [PLACEHOLDER] * 4
    m.check_integrity()


def test_configuration_errors() -> None:
    for bad in (
        {"local_groups": []},
        {"local_groups": ["window"]},
    ):
        with pytest.raises((ConfigError, TypeError)):
            HybridKVCacheManager(8, B, **bad)
    for bad in (("full", 4, 8), ("sliding_window", 0, 8), ("chunked_local", 4, 0)):
        with pytest.raises(ConfigError):
            LocalGroup(*bad)


# ---------------------------------------------------------------- state machine


ZERO = ("zero",)


class HybridMachine(RuleBasedStateMachine):
    """Random admissions, steps (chunked and decode), frees, preemptions and state plans over a full group,
    a window group, optionally a chunked group and a recurrent group, with a shadow of every group's KV and
    every state: every block any group finds or hands out holds exactly that prefix's content, every
    findable checkpoint holds exactly the state after its prefix, a running slot always holds the state
    after its committed tokens (zeroed or restored on admission), references equal holders, and a
    decoding sequence holds at most ceil(W / B) + 1 window blocks.

    A state is modelled as the tuple of tokens it has consumed: the forward pass of a sequence sets its
    slot to ``tokens[:n]``; the plan's copies move those tuples, a zero sets ``ZERO``.
    """

    seqs = Bundle("seqs")

    @initialize(
        window=st.integers(1, 7),
        chunk=st.sampled_from([2, 4, 6]),
        blocks=st.integers(6, 14),
        locals_=st.sampled_from(["window", "both", "none"]),
        recurrent=st.booleans(),
        slots=st.integers(1, 4),
        checkpoints=st.integers(1, 6),
        every=st.sampled_from([1, 2]),
        ratios=st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 2])),
        cross=st.booleans(),
    )
    def setup(
        self,
        window: int,
        chunk: int,
        blocks: int,
        locals_: str,
        recurrent: bool,
        slots: int,
        checkpoints: int,
        every: int,
        ratios: tuple[int, int],
        cross: bool,
    ) -> None:
        self.window = window
        # local groups' blocks are 1 or 2 chain blocks long
        groups = [LocalGroup("sliding_window", window, blocks, B * ratios[0])] if locals_ != "none" else []
        if locals_ == "both":
            groups.append(LocalGroup("chunked_local", chunk, blocks, B * ratios[1]))
        self.sizes = [B, *(g.block_size for g in groups)]  # block size per attention group
        recurrents = [RecurrentGroup(slots, checkpoints, every)] if recurrent or locals_ == "none" else []
        crosses = [CrossAttentionGroup(blocks // 2, 3)] if cross else []
        self.m = HybridKVCacheManager(blocks, B, local_groups=groups, recurrent_groups=recurrents, cross_groups=crosses)
        self.shadow: list[dict[int, object]] = [{} for _ in range(self.m.num_groups)]
        self.first_recurrent = 1 + len(groups)
        self.states: dict[int, dict[int, tuple[int, ...]]] = {
            g: {} for g in range(self.first_recurrent, self.first_recurrent + len(recurrents))
        }
        self.prefix_of: dict[object, tuple[int, ...]] = {}  # block hash -> the tokens it ends
        self.ahead: dict[str, int] = {}  # a failed step's forward pass already ran to this many tokens
        self.count = 0

    def run_plan(self) -> None:
        """The engine's part: run the state plan, in order, before the next forward pass."""
        for op in self.m.take_state_plan():
            states = self.states[op.group]
            states[op.dst] = ZERO if op.src is None else states[op.src]

    def state_of(self, seq: str, n: int) -> tuple[int, ...]:
        return ZERO if n == 0 else tuple(self.m.token_ids(seq)[:n])  # type: ignore[index]

    def check_slots(self, seq: str) -> None:
        """Each running slot of ``seq`` holds the state after its committed tokens (or a failed step's)."""
        committed = self.m.num_computed_tokens(seq)
        allowed = [self.state_of(seq, committed)]
        if seq in self.ahead:
            allowed.append(self.state_of(seq, self.ahead[seq]))
        for g, states in self.states.items():
            assert states.get(self.m.state_slot(seq, g)) in allowed, "a running slot holds another state"

    @rule()
    def plan(self) -> None:
        self.run_plan()

    @rule(target=seqs, head=st.integers(0, 2), length=st.integers(1, 14), skip=st.booleans(), encoder=st.integers(0, 9))
    def add(self, head: int, length: int, skip: bool, encoder: int):
        seq = f"s{self.count}"
        self.count += 1
        tokens = [head * 100 + i for i in range(length)]
        self.m.add_sequence(seq, tokens, skip_cache_read=skip and length % 3 == 0)
        if self.m.group_kinds[-1] == "cross_attention":
            self.m.set_encoder_tokens(seq, encoder)
        return seq

    def tables(self, seq: str) -> list[list[int]]:
        return [self.m.group_block_table(seq, g) for g in range(self.first_recurrent)]

    @rule(seq=seqs, chunk=st.integers(1, 14), stale=st.booleans())
    def admit(self, seq: str, chunk: int, stale: bool) -> None:
        m = self.m
        if m.is_admitted(seq):
            return
        seen = m.lookup(seq).total
        n = min(chunk, m.num_tokens(seq) - seen)
        try:
            table = m.allocate(seq, n, num_cached_tokens=seen if not stale else max(0, seen - m.hit_step))
        except StaleLookupError:
            return
        if table is None:
            return
        hit = table.num_cached_tokens
        event("admission with a hit" if hit else "admission without a hit")
        self.ahead.pop(seq, None)
        hashes = m.block_hashes(seq)
        if self.states:
            if hit:
                event("a hit restored a checkpoint")
            self.run_plan()
            self.check_slots(seq)  # zeroed, or restored to exactly the state after the hit
        for g, group_table in enumerate(self.tables(seq)):
            ratio = self.sizes[g] // B
            for position in range(hit // self.sizes[g]):
                block = group_table[position]
                if block != PLACEHOLDER:
                    key = hashes[(position + 1) * ratio - 1]
                    assert self.shadow[g][block] == key, "a hit handed out another prefix's KV"

    @rule(seq=seqs, new=st.integers(1, 6), sample=st.booleans(), k=st.integers(0, 3))
    def step(self, seq: str, new: int, sample: bool, k: int) -> None:
        m = self.m
        if not m.is_admitted(seq):
            return
        computed = min(m.num_allocated_tokens(seq), m.num_tokens(seq))
        before = m.num_computed_tokens(seq)
        hashes = m.block_hashes(seq)
        tables = self.tables(seq)
        # the forward pass writes every full block it completes, in every group
        for g, group_table in enumerate(tables):
            size = self.sizes[g]
            for position in range(before // size, computed // size):
                assert group_table[position] != PLACEHOLDER
                self.shadow[g][group_table[position]] = hashes[(position + 1) * size // B - 1]
        for position in range(computed // B):
            self.prefix_of[hashes[position]] = tuple(m.token_ids(seq)[: (position + 1) * B])  # type: ignore[index]
        if self.states:  # the plan runs before the forward pass, which moves every running state to `computed`
            self.run_plan()
            self.check_slots(seq)
            for g, states in self.states.items():
                states[m.state_slot(seq, g)] = self.state_of(seq, computed)
        tokens = [[7]] if sample and computed == m.num_tokens(seq) and m.token_ids(seq) is not None else None
        failed = m.step([seq], [computed], tokens, new, k)
        event("step failed" if failed else "step")
        if failed:
            assert m.num_computed_tokens(seq) == before
            self.ahead[seq] = computed
        else:
            self.ahead.pop(seq, None)

    @rule(seq=consumes(seqs))
    def free(self, seq: str) -> None:
        self.m.free(seq)
        self.ahead.pop(seq, None)

    @rule(seq=seqs)
    def preempt(self, seq: str) -> None:
        if self.m.is_admitted(seq):
            self.m.preempt(seq)
            self.ahead.pop(seq, None)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        m = self.m
        m.check_integrity()
        tree = m.tree
        for b in range(m.num_blocks):
            h = tree.hash_of(b)
            if h is not None:
                assert self.shadow[0].get(b) == h, "a findable full-attention block holds other KV"
        for g, local in enumerate(m._locals, 1):
            for b in range(local.pool.num_blocks):
                h = local.index.hash_of(b)
                if h is not None:
                    assert self.shadow[g].get(b) == h, f"a findable block of group {g} holds other KV"
        for g, states in self.states.items():
            recurrent = m._groups.recurrent(g)
            for h, checkpoint in recurrent.index._block_of.items():
                expected = self.prefix_of[h]
                assert states.get(recurrent.state_id(checkpoint)) == expected, "a findable checkpoint holds other state"
                event("a findable checkpoint")
        if not m._locals:
            return
        bound = math.ceil(self.window / self.sizes[1]) + 1
        for seq_id in list(m._seqs):
            if m.is_admitted(seq_id) and m.num_allocated_tokens(seq_id) == m.num_computed_tokens(seq_id) + 1:
                held = sum(b != PLACEHOLDER for b in m.group_block_table(seq_id, 1))
                if held < len(m.group_block_table(seq_id, 1)):
                    event("a decoding sequence released window blocks")
                assert held <= bound, f"{held} window blocks held, bound {bound}"


HybridMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=50, deadline=None)
TestHybridMachine = HybridMachine.TestCase


# ---------------------------------------------------------------- groups of other block sizes


def test_a_group_with_twice_the_block_size_keys_each_block_by_the_hash_that_ends_it() -> None:
    m = HybridKVCacheManager(16, B, local_groups=[LocalGroup("sliding_window", 3, 16, block_size=2 * B)])
    assert m.hit_step == 2 * B
    serve(m, "a", list(range(11)))  # chain blocks of 2 tokens; window blocks of 4
    assert m.group_block_table("a", 0) == [0, 1, 2, 3, 4, 5]
    assert m.group_block_table("a", 1) == [PLACEHOLDER, PLACEHOLDER, 2]  # token 11 attends 9..11
    hashes = m.block_hashes("a")
    assert m._locals[0].index.hash_of(1) == hashes[3]  # group block 1 = chain blocks 2, 3
    m.free("a")
    m.add_sequence("b", list(range(11)))
    assert m.lookup("b").device == 8  # a hit ends on a group block boundary: 10 is not one
    m.add_sequence("c", list(range(10)) + [99])
    with pytest.raises(InvalidArgumentError):
        m.allocate("c", 1, num_cached_tokens=6)  # not a multiple of the hit step
    table = m.allocate("c", 3, num_cached_tokens=8)
    assert table is not None and m.group_block_table("c", 1) == [PLACEHOLDER, 1, 3]
    m.check_integrity()


def test_a_group_block_size_that_is_not_a_multiple_of_the_chain_block_size_is_refused() -> None:
    with pytest.raises(ConfigError):
        HybridKVCacheManager(8, 4, local_groups=[LocalGroup("sliding_window", 4, 8, block_size=6)])
    with pytest.raises(ConfigError):
        LocalGroup("sliding_window", 4, 8, block_size=0)


# ---------------------------------------------------------------- events


def test_every_group_emits_tagged_events_and_the_snapshot_replays_them() -> None:
    sink = EventSink()
    m = HybridKVCacheManager(
        16,
        B,
        local_groups=[LocalGroup("sliding_window", 2, 16)],
        recurrent_groups=[RecurrentGroup(2, 4)],
        event_sink=sink,
    )
    m.add_sequence("a", list(range(7)))
    m.allocate("a", 7)
    m.commit("a", 6)  # 3 full blocks; the window keeps the last; a checkpoint at 6
    m.commit("a", 7)
    m.take_state_plan()
    m.state_plan_done()
    hashes = m.block_hashes("a")
    stored = [(r.event.group, r.event.group_kind, r.event.block_hashes) for r in sink.drain()]
    assert stored == [
        (0, "full", tuple(hashes)),
        (1, "sliding_window", tuple(hashes)),
        (2, "recurrent", (hashes[2],)),
    ]
    snapshot = m.snapshot_events()
    assert {(e.group, e.block_hashes[-1], e.parent_hash) for e in snapshot} == {
        (0, hashes[2], None),
        (1, hashes[2], None),
        (2, hashes[2], hashes[1]),
    }
    m.free("a")
    m._locals[0].index.evict(1)  # the window group's oldest released block goes
    (removed,) = sink.drain()
    assert (removed.event.group, removed.event.group_kind, removed.event.block_hashes) == (
        1,
        "sliding_window",
        (hashes[0],),
    )


def test_drop_last_takes_the_largest_common_hit_below_the_common_hit() -> None:
    """EAGLE recomputes the last matched block: the hit drops to the next one every group serves."""
    for drop in (False, True):
        m = HybridKVCacheManager(
            16, B, local_groups=[LocalGroup("sliding_window", 3, 16)], drop_last_matched_block=drop
        )
        serve(m, "a", list(range(11)))
        m.free("a")
        m._locals[0].index.evict(4)  # window blocks 0-3 go: only hits whose window is in blocks 4.. serve
        m.add_sequence("b", list(range(11)))
        # hits at 10 (window 8..9: block 4) serve; 8 would need block 3: evicted
        assert m.lookup("b").device == (0 if drop else 10)
    m = HybridKVCacheManager(16, B, local_groups=[LocalGroup("sliding_window", 3, 16)], drop_last_matched_block=True)
    serve(m, "a", list(range(11)))
    m.add_sequence("b", list(range(11)))
    assert m.lookup("b").device == 8  # the common hit 10, one block dropped
    table = m.allocate("b", 3, num_cached_tokens=8)
    assert table is not None and table.num_cached_tokens == 8
    m.check_integrity()
