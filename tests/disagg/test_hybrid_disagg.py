"""Prefill/decode handoffs of hybrid models: per-group tables on the wire and on the decode node (issue 14, item 6).

A simulated engine keeps every group's KV as the token ids each block holds; the decode node's
blocks get theirs only through the admission's transfers (or its own earlier computation), so a
transfer that names a wrong block, or one missing, shows up as a block holding the wrong tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvblocks import (
    DecodeManager,
    DuplicateSequenceError,
    HandoffError,
    PrefillHandoff,
    PrefillManager,
)
from kvblocks.disagg import GROUPS_HANDOFF_VERSION, HandoffGroup
from kvblocks.errors import ConfigError
from kvblocks.hybrid import PLACEHOLDER, HybridDecodeManager, HybridKVCacheManager, HybridPrefillManager, LocalGroup
from kvblocks.hybrid.cross import CrossAttentionGroup
from kvblocks.hybrid.recurrent import RecurrentGroup, StateCopy
from tests.support.mutations import byte_mutations, handoffs, json_mutations
from tests.support.snapshots import manager_snapshot

B = 4
WINDOW = LocalGroup("sliding_window", span=6, num_blocks=32)
CHUNK = LocalGroup("chunked_local", span=8, num_blocks=32)
LAYOUT = [WINDOW, CHUNK]


def first_held(group: LocalGroup, n: int) -> int:
    """The first block a group's next token (token n) attends to: tokens n-W+1..n, or n's chunk."""
    start = max(0, n - group.span + 1) if group.kind == "sliding_window" else (n // group.span) * group.span
    return start // B


def snapshot(m: HybridKVCacheManager) -> dict[str, Any]:
    """Every group's pool, tables and index, the base manager's state and the decode counters."""
    out = manager_snapshot(m)
    for g in range(1, m.num_groups):
        pool = m.group_pool(g)
        out[f"group {g}"] = (
            [pool.ref_count(b) for b in range(pool.num_blocks)],
            list(pool.fresh_order()),
            list(pool.idle_lru()),
            {seq_id: m.group_block_table(seq_id, g) for seq_id in m._seqs},
            len(m._locals[g - 1].index),
        )
    out["counters"] = repr(getattr(m, "decode_counters", None))
    return out


class Engine:
    """A node's simulated KV: per group, block -> the token ids written into it."""

    def __init__(self, m: HybridKVCacheManager) -> None:
        self.m = m
        self.kv: list[dict[int, list[int]]] = [{} for _ in range(m.num_groups)]

    def write(self, seq_id: Any, tokens: list[int], start: int, stop: int) -> None:
        """Compute tokens [start, stop) of seq_id into its blocks, in every group."""
        for g in range(self.m.num_groups):
            table = self.m.group_block_table(seq_id, g)
            for t in range(start, stop):
                block = table[t // B]
                assert block != PLACEHOLDER, f"group {g} writes token {t} into a released position"
                slots = self.kv[g].setdefault(block, [])
                del slots[t % B :]
                slots.append(tokens[t])

    def check_window(self, seq_id: Any, tokens: list[int], n: int) -> None:
        """Every block a group holds for seq_id below token n holds exactly its tokens there."""
        for g in range(self.m.num_groups):
            for p, block in enumerate(self.m.group_block_table(seq_id, g)):
                if block != PLACEHOLDER and p * B < n:
                    want = tokens[p * B : min(n, (p + 1) * B)]
                    assert self.kv[g].get(block, [])[: len(want)] == want, (g, p, block)


def prefill(p: HybridPrefillManager, engine: Engine, seq_id: Any, tokens: list[int]) -> PrefillHandoff:
    p.add_sequence(seq_id, tokens)
    hit = p.lookup(seq_id).device
    assert p.allocate(seq_id, len(tokens) - hit) is not None
    p.check_integrity()
    engine.write(seq_id, tokens, hit, len(tokens))
    p.commit(seq_id, len(tokens))
    p.check_integrity()
    handoff = p.finish_prefill(seq_id)
    p.check_integrity()
    return handoff


def move(admission: Any, source: Engine, target: Engine) -> None:
    for g, moves in enumerate(admission.group_transfers):
        for src, dst in moves:
            target.kv[g][dst] = list(source.kv[g][src])


def check_admission(d: HybridDecodeManager, handoff: PrefillHandoff, admission: Any, layout: list[LocalGroup]) -> None:
    """Group 0 copies every block past the decode-side hit; a local group holds exactly its window at
    the prompt's end and copies the part of it past the hit, from the positions the handoff names."""
    assert admission is not None
    n = handoff.num_prompt_tokens
    total = math.ceil(n / B)
    hits = total - len(admission.transfers)
    assert admission.transfers == tuple(zip(handoff.source_blocks[hits:], admission.table[hits:], strict=True))
    assert admission.group_transfers[0] == admission.transfers
    assert admission.group_tables[0] == tuple(admission.table) == tuple(d.group_block_table(handoff.seq_id, 0))
    for g, group in enumerate(layout, 1):
        first = first_held(group, n)
        table = d.group_block_table(handoff.seq_id, g)
        assert tuple(table) == admission.group_tables[g]
        assert table[:first] == [PLACEHOLDER] * first and PLACEHOLDER not in table[first:]
        sources = handoff.groups[g - 1].blocks
        assert admission.group_transfers[g] == tuple((sources[p], table[p]) for p in range(max(first, hits), total))
        if group.kind == "sliding_window":
            assert total - first <= math.ceil(group.span / B) + 1


def decode_steps(d: HybridDecodeManager, engine: Engine, seq_id: Any, tokens: list[int], count: int) -> None:
    """Decode ``count`` tokens with step(), checking integrity, the window bound and the KV each step."""
    window = next(g for g in d._locals if g.kind.name == "sliding_window")
    bound = math.ceil(window.span / B) + 1
    for i in range(count):
        n = len(tokens)
        token = 7000 + i
        assert d.step([seq_id], [n], [[token]]) == []
        tokens.append(token)
        engine.write(seq_id, tokens, n, n + 1)
        d.check_integrity()
        engine.check_window(seq_id, tokens, n + 1)
        sliding = [g for g in range(1, d.num_groups) if d._locals[g - 1].kind.name == "sliding_window"]
        for g in sliding:
            assert sum(b != PLACEHOLDER for b in d.group_block_table(seq_id, g)) <= bound


# ---------------------------------------------------------------- end to end


def test_a_long_prompt_moves_only_each_local_groups_window() -> None:
    p = HybridPrefillManager(32, B, local_groups=LAYOUT)
    d = HybridDecodeManager(32, B, local_groups=LAYOUT, reserve_blocks_per_sequence=1)
    pe, de = Engine(p), Engine(d)
    tokens = list(range(100, 130))  # 30 tokens, 8 blocks; the window (6) and the chunk (8) are far shorter
    handoff = prefill(p, pe, "r", tokens)

    # the handoff: every full-attention block; per local group the window at token 30 only
    assert handoff.version == GROUPS_HANDOFF_VERSION
    assert [(g.kind, g.span) for g in handoff.groups] == [("sliding_window", 6), ("chunked_local", 8)]
    for g, group in enumerate(handoff.groups, 1):
        first = first_held(LAYOUT[g - 1], 30)
        assert first == 6  # tokens 25..30 (window) and the chunk 24..31 both start in block 6
        assert group.blocks == tuple(p.group_block_table("r", g))
        assert group.blocks[:first] == (PLACEHOLDER,) * first and PLACEHOLDER not in group.blocks[first:]
    wire = handoff.to_bytes()
    assert PrefillHandoff.from_bytes(wire) == handoff

    admission = d.accept_handoff(PrefillHandoff.from_bytes(wire), tokens)
    d.check_integrity()
    check_admission(d, handoff, admission, LAYOUT)
    assert len(admission.transfers) == 8  # a cold decode node
    for g in (1, 2):
        table = d.group_block_table("r", g)
        assert table[:6] == [PLACEHOLDER] * 6 and PLACEHOLDER not in table[6:]
        assert admission.group_transfers[g] == (
            (handoff.groups[g - 1].blocks[6], table[6]),
            (handoff.groups[g - 1].blocks[7], table[7]),
        )
        assert d.group_pool(g).num_in_use == 2 <= math.ceil(6 / B) + 1
    assert d.decode_counters.transferred_blocks == 8 + 2 + 2

    move(admission, pe, de)
    d.receive_done("r")
    p.transfer_done("r")
    d.check_integrity()
    p.check_integrity()
    de.check_window("r", tokens, 30)
    decode_steps(d, de, "r", tokens, 13)  # past two window moves and a chunk boundary

    # a second request sharing the prompt: whatever the decode node holds of it is kept, the rest copied
    d.free("r")
    d.check_integrity()
    other = tokens[:28] + [1, 2, 3]
    h2 = prefill(p, pe, "s", other)
    admission2 = d.accept_handoff(h2, other)
    d.check_integrity()
    check_admission(d, h2, admission2, LAYOUT)
    move(admission2, pe, de)
    d.receive_done("s")
    d.check_integrity()
    de.check_window("s", other, 31)
    decode_steps(d, de, "s", other, 5)


def test_a_failed_receive_returns_every_groups_blocks() -> None:
    p = HybridPrefillManager(32, B, local_groups=LAYOUT)
    d = HybridDecodeManager(32, B, local_groups=LAYOUT)
    before = snapshot(d)
    tokens = list(range(30))
    handoff = prefill(p, Engine(p), "r", tokens)
    assert d.accept_handoff(handoff, tokens) is not None
    d.receive_done("r", ok=False)
    d.check_integrity()
    after = snapshot(d)
    for g in range(d.num_groups):
        pool = d.group_pool(g)
        assert pool.num_in_use == 0 and pool.num_free == pool.num_blocks
    assert "r" not in d and after["tree"] == before["tree"] == {}


def test_plain_handoff_bytes_are_todays_format() -> None:
    """Without local groups the handoff is version 1 with exactly the nine fields it always had."""
    p = PrefillManager(16, B)
    p.add_sequence("r", list(range(9)))
    p.allocate("r", 9)
    p.commit("r", 9)
    h = p.finish_prefill("r")
    expected = {
        "version": 1,
        "seq_id": "r",
        "num_prompt_tokens": 9,
        "block_hashes": json.loads(h.to_bytes())["block_hashes"],
        "source_blocks": [0, 1, 2],
        "cached": [0, 0, 0],
        "scheme": p.config.hash_scheme,
        "block_size": B,
        "key_space": h.key_space,
    }
    assert h.to_bytes() == json.dumps(expected, separators=(",", ":")).encode()
    assert h.groups == () and PrefillHandoff.from_bytes(h.to_bytes()) == h


# ---------------------------------------------------------------- refusals


def _hybrid_handoff(layout: list[LocalGroup] = LAYOUT, tokens: list[int] | None = None) -> PrefillHandoff:
    p = HybridPrefillManager(32, B, local_groups=layout)
    return prefill(p, Engine(p), "r", tokens or list(range(30)))


def _warm_decode(layout: list[LocalGroup], **kwargs: Any) -> HybridDecodeManager:
    """A decode node already running one sequence (so a refusal has state to leave alone)."""
    d = HybridDecodeManager(32, B, local_groups=layout, **kwargs)
    other = list(range(500, 510))
    p = HybridPrefillManager(32, B, local_groups=layout)
    assert d.accept_handoff(prefill(p, Engine(p), "o", other), other) is not None
    d.receive_done("o")
    return d


@pytest.mark.parametrize(
    "layout",
    [
        [WINDOW],  # fewer groups
        [WINDOW, CHUNK, WINDOW],  # more groups
        [CHUNK, WINDOW],  # same groups, another order
        [dataclasses.replace(WINDOW, span=7), CHUNK],  # another window
        [WINDOW, dataclasses.replace(CHUNK, span=12)],  # another chunk
        [LocalGroup("chunked_local", 6, 32), CHUNK],  # another kind, same span
    ],
    ids=["fewer", "more", "order", "window", "chunk", "kind"],
)
def test_a_decode_node_of_another_layout_refuses_and_changes_nothing(layout: list[LocalGroup]) -> None:
    d = _warm_decode(layout)
    before = snapshot(d)
    with pytest.raises(HandoffError, match="local groups"):
        d.accept_handoff(_hybrid_handoff(), list(range(30)))
    assert snapshot(d) == before
    d.check_integrity()


def test_plain_and_hybrid_nodes_refuse_each_others_handoffs() -> None:
    plain = DecodeManager(32, B)
    before = manager_snapshot(plain)
    with pytest.raises(HandoffError, match="local groups"):
        plain.accept_handoff(_hybrid_handoff(), list(range(30)))
    assert manager_snapshot(plain) == before
    p = PrefillManager(32, B)
    p.add_sequence("r", list(range(30)))
    p.allocate("r", 30)
    p.commit("r", 30)
    d = _warm_decode(LAYOUT)
    before = snapshot(d)
    with pytest.raises(HandoffError, match="local groups"):
        d.accept_handoff(p.finish_prefill("r"), list(range(30)))
    assert snapshot(d) == before


@pytest.mark.parametrize("short", [0, 1, 2], ids=["full group", "window group", "chunk group"])
def test_no_room_in_any_group_refuses_and_changes_no_group(short: int) -> None:
    """A decode node running one 10-token sequence holds [3, 2, 1] blocks per group (window 6 at token 10:
    blocks 1-2; chunk 8: block 2). A 30-token handoff needs [8, 2, 2] more, and each group keeps a reserve
    of one block per running sequence, the new one included: [13, 6, 5] blocks fit exactly."""
    sizes = [13, 6, 5]
    sizes[short] -= 1
    layout = [dataclasses.replace(WINDOW, num_blocks=sizes[1]), dataclasses.replace(CHUNK, num_blocks=sizes[2])]
    other = list(range(500, 510))

    def node(reserve: int) -> HybridDecodeManager:
        d = HybridDecodeManager(sizes[0], B, local_groups=layout, reserve_blocks_per_sequence=reserve)
        po = HybridPrefillManager(32, B, local_groups=LAYOUT)
        assert d.accept_handoff(prefill(po, Engine(po), "o", other), other) is not None
        d.receive_done("o")
        assert [d.group_pool(g).num_in_use for g in range(3)] == [3, 2, 1]
        return d

    d = node(1)
    handoff = _hybrid_handoff()
    before = snapshot(d)
    assert d.accept_handoff(handoff, list(range(30))) is None
    assert d.decode_counters.handoffs_refused == 1
    after = snapshot(d)
    assert after.pop("counters") != before.pop("counters")
    assert after == before
    d.check_integrity()
    roomy = node(0)  # without the reserve, the same handoff fits in every group
    check_admission(roomy, handoff, roomy.accept_handoff(handoff, list(range(30))), LAYOUT)
    roomy.check_integrity()


def test_a_handoff_is_refused_on_other_prompts_and_twice() -> None:
    d = _warm_decode(LAYOUT)
    handoff = _hybrid_handoff()
    before = snapshot(d)
    with pytest.raises(HandoffError):
        d.accept_handoff(handoff, list(range(1, 31)))
    assert snapshot(d) == before
    assert d.accept_handoff(handoff, list(range(30))) is not None
    d.check_integrity()
    before = snapshot(d)
    with pytest.raises(DuplicateSequenceError):
        d.accept_handoff(handoff, list(range(30)))
    assert snapshot(d) == before


# ---------------------------------------------------------------- the wire


def _tampered(changes: dict[str, Any], group: dict[str, Any] | None = None) -> bytes:
    raw = json.loads(_hybrid_handoff().to_bytes())
    raw.update(changes)
    if group is not None:
        raw["groups"][0].update(group)
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    ("changes", "group"),
    [
        ({"version": 1}, None),  # version 1 carries no groups
        ({"groups": []}, None),
        ({"groups": {}}, None),
        ({"groups": [[]]}, None),
        ({"groups": [None]}, None),
        ({}, {"extra": 1}),
        ({}, {"kind": "recurrent"}),
        ({}, {"kind": "full"}),
        ({}, {"kind": 3}),
        ({}, {"span": 0}),
        ({}, {"span": -6}),
        ({}, {"span": True}),
        ({}, {"span": 6.0}),
        ({}, {"span": 2**63}),
        ({}, {"span": 2}),  # a window of 2 at token 30 starts in block 7: block 6 should be released
        ({}, {"blocks": [-1] * 6 + [0]}),  # one short
        ({}, {"blocks": [-1] * 6 + [0, 1, 2]}),  # one long
        ({}, {"blocks": [-1] * 5 + [-2, 0, 1]}),
        ({}, {"blocks": [-1] * 6 + [0, True]}),
        ({}, {"blocks": [-1] * 6 + [0, "1"]}),
        ({}, {"blocks": [-1] * 6 + [0, 2**63]}),
        ({}, {"blocks": [-1] * 7 + [1]}),  # a window position without its block
        ({}, {"blocks": [-1] * 5 + [9, 0, 1]}),  # a block where the prefill node released it
        ({}, {"blocks": "-1"}),
    ],
)
def test_malformed_groups_are_refused(changes: dict[str, Any], group: dict[str, Any] | None) -> None:
    with pytest.raises(HandoffError):
        PrefillHandoff.from_bytes(_tampered(changes, group))


def test_a_version_2_handoff_needs_groups() -> None:
    raw = json.loads(_hybrid_handoff().to_bytes())
    del raw["groups"]
    with pytest.raises(HandoffError, match="version"):
        PrefillHandoff.from_bytes(json.dumps(raw).encode())
    h = _hybrid_handoff()
    for bad in (
        dataclasses.replace(h, version=1),
        dataclasses.replace(h, groups=()),
        dataclasses.replace(h, groups=[]),
    ):
        with pytest.raises(HandoffError):
            bad.validate()


@st.composite
def hybrid_handoffs(draw: st.DrawFn) -> PrefillHandoff:
    """Valid handoffs with one to three groups of random kinds (local or recurrent) and spans."""
    base = draw(handoffs())
    n, size, total = base.num_prompt_tokens, base.block_size, len(base.source_blocks)
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["sliding_window", "chunked_local", "recurrent"]))
        span = draw(st.integers(1, 40))
        if kind == "recurrent":  # one state id
            groups.append(HandoffGroup(kind, span, (draw(st.integers(0, 2**40)),)))
            continue
        start = max(0, n - span + 1) if kind == "sliding_window" else n - n % span
        first = start // size
        ids = draw(st.lists(st.integers(0, 2**40), min_size=total - first, max_size=total - first))
        groups.append(HandoffGroup(kind, span, (PLACEHOLDER,) * first + tuple(ids)))
    return dataclasses.replace(base, version=GROUPS_HANDOFF_VERSION, groups=tuple(groups))


VALID_HYBRID_BYTES = hybrid_handoffs().map(lambda h: h.to_bytes())
FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(data: Any) -> PrefillHandoff | None:
    try:
        handoff = PrefillHandoff.from_bytes(data)
    except HandoffError:
        return None
    assert PrefillHandoff.from_bytes(handoff.to_bytes()) == handoff
    assert (handoff.version == GROUPS_HANDOFF_VERSION) == bool(handoff.groups)
    return handoff


@settings(max_examples=150, deadline=None)
@given(hybrid_handoffs())
def test_valid_hybrid_handoffs_round_trip(handoff: PrefillHandoff) -> None:
    assert PrefillHandoff.from_bytes(handoff.to_bytes()) == handoff


@FUZZ
@given(VALID_HYBRID_BYTES.flatmap(byte_mutations))
def test_byte_damaged_hybrid_handoffs_are_a_handoff_or_a_handoff_error(data: bytes) -> None:
    _check(data)


@FUZZ
@given(VALID_HYBRID_BYTES.flatmap(json_mutations))
def test_json_damaged_hybrid_handoffs_are_a_handoff_or_a_handoff_error(data: bytes) -> None:
    _check(data)


REAL = _hybrid_handoff(tokens=list(range(100, 119))).to_bytes()  # 19 tokens: window blocks 3, 4; chunk block 4


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(byte_mutations(REAL), json_mutations(REAL)))
def test_a_damaged_hybrid_handoff_is_refused_or_accepted_whole(data: bytes) -> None:
    d = _warm_decode(LAYOUT)
    before = snapshot(d)
    try:
        handoff = PrefillHandoff.from_bytes(data)
        admission = d.accept_handoff(handoff, list(range(100, 119)))
    except (HandoffError, DuplicateSequenceError):
        assert snapshot(d) == before
    else:
        assert admission is not None  # plenty of room: an acceptable handoff is accepted
        for g, group in enumerate(handoff.groups, 1):
            table = d.group_block_table(handoff.seq_id, g)
            held = [p for p, b in enumerate(table) if b != PLACEHOLDER]
            assert held == [p for p, b in enumerate(group.blocks) if b != PLACEHOLDER]
            assert [src for src, _ in admission.group_transfers[g]] == [group.blocks[p] for p in held]
    d.check_integrity()


# ---------------------------------------------------------------- random layouts and prompts


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=st.integers(1, 20),
    chunk=st.integers(1, 20),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    shared=st.integers(0, 30),
    decode_cache=st.booleans(),
)
def test_random_prompts_and_windows_hand_off_exactly_the_window(
    window: int, chunk: int, lengths: list[int], shared: int, decode_cache: bool
) -> None:
    layout = [LocalGroup("sliding_window", window, 64), LocalGroup("chunked_local", chunk, 64)]
    p = HybridPrefillManager(64, B, local_groups=layout)
    d = HybridDecodeManager(64, B, local_groups=layout, enable_prefix_caching=decode_cache)
    pe, de = Engine(p), Engine(d)
    for i, length in enumerate(lengths):
        tokens = list(range(shared)) + [1000 * (i + 1) + t for t in range(length)]
        n = len(tokens)
        handoff = prefill(p, pe, i, tokens)
        total = math.ceil(n / B)
        for g, group in enumerate(layout, 1):
            first = first_held(group, n)
            assert handoff.groups[g - 1].blocks == (PLACEHOLDER,) * first + tuple(p.group_block_table(i, g)[first:])
        admission = d.accept_handoff(PrefillHandoff.from_bytes(handoff.to_bytes()), tokens)
        d.check_integrity()
        check_admission(d, handoff, admission, layout)
        if not decode_cache:
            assert len(admission.transfers) == total
        move(admission, pe, de)
        d.receive_done(i)
        p.transfer_done(i)
        d.check_integrity()
        p.check_integrity()
        de.check_window(i, tokens, n)
        decode_steps(d, de, i, tokens, 3)
        d.free(i)
        d.check_integrity()


def test_a_local_group_of_another_block_size_cannot_be_handed_off() -> None:
    """Refused when the role is set up (a prefill or decode node that could never hand off), not at the
    first handoff."""
    wide = [LocalGroup("sliding_window", span=6, num_blocks=16, block_size=8)]
    for role in (HybridPrefillManager, HybridDecodeManager):
        with pytest.raises(ConfigError, match="block size"):
            role(16, 4, local_groups=wide)
    mixed = HybridKVCacheManager(16, 4, local_groups=wide)  # a mixed node hands nothing off: it may
    mixed.add_sequence("r", list(range(17)))
    assert mixed.allocate("r", 17) is not None


# ---------------------------------------------------------------- recurrent states


def _recurrent_nodes(decode_slots: int = 2, every: int = 1) -> tuple[HybridPrefillManager, HybridDecodeManager]:
    p = HybridPrefillManager(32, B, local_groups=[WINDOW], recurrent_groups=[RecurrentGroup(2, 4)])
    d = HybridDecodeManager(32, B, local_groups=[WINDOW], recurrent_groups=[RecurrentGroup(decode_slots, 4, every)])
    return p, d


def _prefilled(p: HybridPrefillManager, seq_id: str, tokens: list[int]) -> PrefillHandoff:
    p.add_sequence(seq_id, tokens)
    p.allocate(seq_id, len(tokens))
    p.commit(seq_id, len(tokens))
    return p.finish_prefill(seq_id)


def test_a_recurrent_state_is_handed_off_as_one_copy_of_the_state_after_the_prompt() -> None:
    p, d = _recurrent_nodes()
    p.add_sequence("other", [9] * 5)
    p.allocate("other", 5)  # takes prefill slot 0: the handed-off sequence runs in slot 1
    tokens = list(range(17))
    handoff = _prefilled(p, "r", tokens)
    assert handoff.groups[-1] == HandoffGroup("recurrent", B, (p.state_slot("r", 2),)) and p.state_slot("r", 2) == 1
    assert PrefillHandoff.from_bytes(handoff.to_bytes()) == handoff
    d.take_state_plan()
    admission = d.accept_handoff(PrefillHandoff.from_bytes(handoff.to_bytes()), tokens)
    assert admission is not None
    slot = d.state_slot("r", 2)
    assert admission.group_tables[2] == (slot,) and admission.group_transfers[2] == ((1, slot),)
    assert d.take_state_plan() == []  # the state arrives by the transfer: nothing to zero or restore
    d.check_integrity()
    p.check_integrity()
    d.receive_done("r")
    p.transfer_done("r")
    assert "r" not in p
    assert d.step(["r"], [17], [[99]], 3) == []  # decode: commit 17, slots to 20
    d.append_tokens("r", [100, 101])
    d.commit("r", 20)  # a checkpoint boundary: the received-then-decoded state is saved
    assert d.take_state_plan() == [StateCopy(2, slot, 2 + 0)]
    d.check_integrity()


def test_a_decode_node_without_a_free_slot_refuses_and_changes_nothing() -> None:
    p, d = _recurrent_nodes(decode_slots=1)
    d.add_sequence("busy", [5] * 6)
    d.allocate("busy", 6)
    handoff = _prefilled(p, "r", list(range(17)))
    before = snapshot_without_recurrent(d)
    assert d.accept_handoff(handoff, list(range(17))) is None
    assert snapshot_without_recurrent(d) == before and "r" not in d
    d.free("busy")
    assert d.accept_handoff(handoff, list(range(17))) is not None
    d.check_integrity()


def snapshot_without_recurrent(m: HybridKVCacheManager) -> dict[str, Any]:
    out = manager_snapshot(m)
    out["window"] = {seq_id: m.group_block_table(seq_id, 1) for seq_id in m._seqs}
    out["slots"] = list(m._recurrents[0].free_slots)
    return out


def test_recurrent_layouts_must_match_and_recurrent_groups_carry_one_state_id() -> None:
    p, _ = _recurrent_nodes()
    handoff = _prefilled(p, "r", list(range(17)))
    _, other = _recurrent_nodes(every=2)  # checkpoints every 8 tokens: another layout
    with pytest.raises(HandoffError):
        other.accept_handoff(handoff, list(range(17)))
    plain_window = HybridDecodeManager(32, B, local_groups=[WINDOW])
    with pytest.raises(HandoffError):
        plain_window.accept_handoff(handoff, list(range(17)))
    raw = json.loads(handoff.to_bytes())
    for bad in ([1, 2], [], [-1], ["1"], [True], [2**63]):
        raw["groups"][-1]["blocks"] = bad
        with pytest.raises(HandoffError):
            PrefillHandoff.from_bytes(json.dumps(raw).encode())


def test_cross_attention_groups_are_not_handed_off() -> None:
    for role in (HybridPrefillManager, HybridDecodeManager):
        with pytest.raises(ConfigError, match="cross-attention"):
            role(16, B, cross_groups=[CrossAttentionGroup(4)])
