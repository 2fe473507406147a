"""Prefill/decode disaggregation: roles, the handoff, the decode reserve, cached-token accounting."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvblocks import (
    CacheConfig,
    CachedTokens,
    ConfigError,
    DecodeManager,
    DisaggConfig,
    DuplicateSequenceError,
    HandoffError,
    InvalidArgumentError,
    KVCacheManager,
    PrefillHandoff,
    PrefillManager,
    SequenceStateError,
    UnknownSequenceError,
    manager_for_role,
)
from tests.support.mooncake import BLOCK as TRACE_BLOCK
from tests.support.mooncake import load as load_trace
from tests.support.snapshots import assert_unchanged as _assert_unchanged
from tests.support.snapshots import manager_snapshot

B = 4


@contextlib.contextmanager
def assert_unchanged(m: KVCacheManager) -> Iterator[None]:
    """The block raises and leaves the manager exactly as it was (snapshot and integrity)."""
    before = manager_snapshot(m)
    yield
    _assert_unchanged(m, before)


SYSTEM = list(range(500, 512))  # 3 full blocks


def prompt(tail: int, length: int = 5) -> list[int]:
    return SYSTEM + [1000 * tail + i for i in range(length)]


def prefilled(p: PrefillManager, seq_id, tokens: list[int]) -> PrefillHandoff:
    p.add_sequence(seq_id, tokens)
    assert p.allocate(seq_id, len(tokens) - p.lookup(seq_id).device) is not None
    p.commit(seq_id, len(tokens))
    return p.finish_prefill(seq_id)


# ---------------------------------------------------------------- roles


def test_roles_are_validated_and_pick_the_manager() -> None:
    config = CacheConfig(num_blocks=16, block_size=B)
    assert type(manager_for_role(config)) is KVCacheManager
    assert type(manager_for_role(config, DisaggConfig(role="prefill"))) is PrefillManager
    decode = manager_for_role(config, DisaggConfig(role="decode", reserve_blocks_per_sequence=3))
    assert type(decode) is DecodeManager and decode.role == "decode"
    assert KVCacheManager(4, B).role == "mixed"
    for bad in ({"role": "both"}, {"reserve_blocks_per_sequence": -1}, {"reserve_blocks_per_sequence": True}):
        with pytest.raises(ConfigError):
            DisaggConfig(**bad)
    with pytest.raises(ConfigError):
        DecodeManager.from_config(config, disagg=DisaggConfig(role="prefill"))


def replay_trace(m: KVCacheManager, requests) -> None:
    for i, (hashes, length) in enumerate(requests):
        m.add_sequence(i, block_hashes=hashes, num_tokens=length)
        assert m.allocate(i, length - m.lookup(i).device) is not None
        m.commit(i, length)
        if isinstance(m, PrefillManager):
            m.finish_prefill(i)
            m.transfer_done(i)
        else:
            m.free(i)


@pytest.mark.parametrize("fraction", [0.05, 0.25, 2.0])
def test_a_prefill_node_reaches_a_mixed_nodes_hit_rate(fraction: float) -> None:
    """Mooncake's conversation trace through both roles, with pools that evict and one that does not."""
    requests = load_trace()[:400]
    blocks = max(int(sum(len(h) for h, _ in requests) * fraction), 80)
    mixed, prefill = KVCacheManager(blocks, TRACE_BLOCK), PrefillManager(blocks, TRACE_BLOCK)
    replay_trace(mixed, requests)
    replay_trace(prefill, requests)
    assert mixed.stats.hit_tokens > 0
    assert prefill.stats == mixed.stats
    prefill.check_integrity()


def test_only_matched_and_committed_blocks_are_findable_on_a_prefill_node() -> None:
    p = PrefillManager(16, B)
    p.add_sequence("a", prompt(1))
    p.allocate("a", 17)
    p.commit("a", 9)  # blocks 0 and 1 written; 2..4 only allocated
    assert len(p.tree) == 2
    p.add_sequence("b", prompt(1))
    assert p.lookup("b").device == 8


# ---------------------------------------------------------------- prefill handoff


def test_finish_prefill_describes_the_prompt_and_holds_its_blocks() -> None:
    p = PrefillManager(16, B)
    prefilled(p, "warm", prompt(0))
    p.transfer_done("warm")
    h = prefilled(p, "r", prompt(1, 6))  # 18 tokens: 4 full blocks + 2 tokens
    table = list(p.block_table("r"))
    assert h.seq_id == "r" and h.num_prompt_tokens == 18
    assert h.source_blocks == tuple(table) and len(table) == 5
    assert h.block_hashes == p.block_hashes("r")[:4]
    assert h.cached == CachedTokens(device=12, num_prompt_tokens=18)  # the system prompt's 3 blocks
    assert all(p.pool.ref_count(b) >= 1 for b in table)
    assert p.is_transferring("r") and p.num_transferring == 1
    p.check_integrity()
    p.transfer_done("r")
    assert not p.is_transferring("r") and "r" not in p
    p.add_sequence("again", prompt(1, 6))
    assert p.lookup("again").device == 16  # its blocks are cached now


@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.free("r"),
        lambda p: p.preempt("r"),
        lambda p: p.allocate("r", 1),
        lambda p: p.commit("r", 17),
        lambda p: p.finish_prefill("r"),
    ],
    ids=["free", "preempt", "allocate", "commit", "finish twice"],
)
def test_a_sequence_being_transferred_cannot_be_touched(call) -> None:
    p = PrefillManager(16, B)
    prefilled(p, "r", prompt(1))
    with assert_unchanged(p), pytest.raises(SequenceStateError):
        call(p)


def test_finish_prefill_needs_the_whole_prompt_committed() -> None:
    p = PrefillManager(16, B)
    p.add_sequence("r", prompt(1))
    with pytest.raises(SequenceStateError):
        p.finish_prefill("r")  # not admitted
    p.allocate("r", 17)
    p.commit("r", 16)
    with assert_unchanged(p), pytest.raises(SequenceStateError):
        p.finish_prefill("r")
    with pytest.raises(UnknownSequenceError):
        p.transfer_done("nobody")
    p.commit("r", 17)
    with pytest.raises(SequenceStateError):
        p.transfer_done("r")  # not handed off yet
    p.add_sequence(("tuple", "id"), prompt(2))
    p.allocate(("tuple", "id"), 17)
    p.commit(("tuple", "id"), 17)
    with pytest.raises(InvalidArgumentError):
        p.finish_prefill(("tuple", "id"))  # cannot cross the wire


def test_the_handoff_reports_the_first_admissions_hits_not_a_readmissions() -> None:
    p = PrefillManager(16, B)
    prefilled(p, "warm", prompt(0))
    p.transfer_done("warm")
    p.add_sequence("r", prompt(1))
    p.allocate("r", 17 - 12)
    p.commit("r", 17)  # its own blocks 3 and 4 are cached now
    p.preempt("r")
    p.allocate("r", 17 - p.lookup("r").device)
    assert p.num_computed_tokens("r") == 16  # re-admission found its own blocks
    p.commit("r", 17)
    assert p.finish_prefill("r").cached.total == 12
    assert p.stats.readmission_hit_tokens == 16


def test_handoffs_cross_the_wire_as_bytes() -> None:
    p = PrefillManager(16, B)
    h = prefilled(p, 7, prompt(1))
    assert PrefillHandoff.from_bytes(h.to_bytes()) == h
    ints = PrefillManager(16, B, hash_scheme="xxh3-64-1337")
    hi = prefilled(ints, "x", prompt(1))
    assert PrefillHandoff.from_bytes(hi.to_bytes()) == hi


def _tamper(h: PrefillHandoff, **changes) -> bytes:
    raw = json.loads(h.to_bytes())
    raw.update(changes)
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    "changes",
    [
        {"version": 2},
        {"num_prompt_tokens": 30},
        {"source_blocks": [0, 1]},
        {"source_blocks": [0, 1, 2, 3, -1]},
        {"source_blocks": [0, 1, 2, 3, "4"]},
        {"source_blocks": [0, 1, 2, 3, True]},
        {"block_hashes": ["zz"]},
        {"block_hashes": {"kind": "bytes", "width": 16, "hex": "zz"}},
        {"block_hashes": {"kind": "bytes", "width": 5, "hex": "00" * 16}},
        {"block_hashes": {"kind": "int", "values": [-1]}},
        {"block_hashes": {"kind": "float"}},
        {"cached": [99, 0, 0]},
        {"seq_id": True},
        {"block_size": 0},
    ],
)
def test_malformed_handoffs_are_refused(changes) -> None:
    p = PrefillManager(16, B)
    h = prefilled(p, "r", prompt(1))
    with pytest.raises(HandoffError):
        PrefillHandoff.from_bytes(_tamper(h, **changes))


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]", b"{}", b'{"version": 1}'])
def test_garbage_is_not_a_handoff(data: bytes) -> None:
    with pytest.raises(HandoffError):
        PrefillHandoff.from_bytes(data)


def _handoff_text(**changes: str) -> bytes:
    """A valid handoff with some fields' JSON text replaced verbatim (what json.dumps cannot write)."""
    h = prefilled(PrefillManager(16, B), "r", prompt(1))
    raw = json.loads(h.to_bytes())
    for key in changes:
        raw[key] = f"@{key}@"
    text = json.dumps(raw)
    for key, value in changes.items():
        text = text.replace(f'"@{key}@"', value)
    return text.encode()


def _valid_handoff_bytes() -> bytes:
    return prefilled(PrefillManager(16, B), "r", prompt(1)).to_bytes()


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 100_000,  # json's RecursionError
        b'{"version": 1, "seq_id": ' + b"[" * 100_000,
        _handoff_text(version="true"),  # True == 1, but a bool is no version
        _handoff_text(version="1.0"),
        _handoff_text(num_prompt_tokens="9" * 5000),  # int's digit limit inside json
        _handoff_text(scheme="5"),  # every field is typed, not only the counts
        _handoff_text(key_space='["k"]'),
        _handoff_text(scheme='"\\ud800"'),  # a lone surrogate: no encoder can write it back
        _handoff_text(seq_id="{}"),
        _handoff_text(cached="[NaN, 0, 0]"),
        _handoff_text(cached='"abc"'),
        _handoff_text(cached="[0, 0, 0, 0]"),
        _handoff_text(source_blocks="[0, 1, 2, 3, 1180591620717411303424]"),  # 2**70: no block id
        _handoff_text(source_blocks='"01234"'),
        _handoff_text(block_hashes='"' + "9" * 5000 + ':00"'),
        _handoff_text(
            num_prompt_tokens="1" + "0" * 30, block_size="1" + "0" * 30, block_hashes="[1]", source_blocks="[0]"
        ),  # consistent, but absurd
        _valid_handoff_bytes().replace(b"{", b'{"scheme": "sha256", ', 1),  # a repeated key
        _valid_handoff_bytes().decode().encode("utf-16"),  # only UTF-8 is JSON between systems
        2**62,  # not bytes: bytes(2**62) is a MemoryError
    ],
    ids=[
        "nesting-100k",
        "nested-seq-id",
        "version-true",
        "version-float",
        "prompt-5000-digits",
        "scheme-int",
        "key-space-list",
        "scheme-lone-surrogate",
        "seq-id-object",
        "cached-nan",
        "cached-str",
        "cached-4-counts",
        "source-block-2**70",
        "source-blocks-str",
        "width-5000-digits",
        "absurd-counts",
        "repeated-key",
        "utf-16",
        "int-not-bytes",
    ],
)
def test_handoff_bytes_from_outside_raise_only_handoff_error(data) -> None:
    with pytest.raises(HandoffError):
        PrefillHandoff.from_bytes(data)


# ---------------------------------------------------------------- decode


def test_accept_maps_every_prompt_block_and_commits_on_receipt() -> None:
    p, d = PrefillManager(16, B), DecodeManager(16, B, reserve_blocks_per_sequence=1)
    h = prefilled(p, "r", prompt(1))
    with assert_unchanged(d), pytest.raises(HandoffError):
        d.accept_handoff(h, prompt(2))  # another prompt
    admission = d.accept_handoff(h, prompt(1))
    assert admission.transfers == tuple(zip(h.source_blocks, [0, 1, 2, 3, 4], strict=True))
    assert list(admission.table) == [0, 1, 2, 3, 4]
    assert admission.cached == h.cached
    assert d.is_receiving("r") and d.num_computed_tokens("r") == 0
    for call in (lambda: d.allocate("r", 1), lambda: d.commit("r", 17), lambda: d.free("r"), lambda: d.preempt("r")):
        with pytest.raises(SequenceStateError):
            call()
    d.check_integrity()
    d.receive_done("r")
    assert d.num_computed_tokens("r") == 17 and len(d.tree) == 4
    with pytest.raises(DuplicateSequenceError):
        d.accept_handoff(h, prompt(1))
    d.append_tokens("r", [5])
    assert list(d.allocate("r", 1)) == [0, 1, 2, 3, 4]
    d.commit("r", 18)
    d.check_integrity()


def test_a_failed_receive_drops_the_sequence_and_returns_its_blocks() -> None:
    p, d = PrefillManager(16, B), DecodeManager(8, B)
    d.accept_handoff(prefilled(p, "r", prompt(1)), prompt(1))
    d.receive_done("r", ok=False)
    assert "r" not in d and d.num_free_blocks == 8 and len(d.tree) == 0
    d.check_integrity()


def test_the_decode_prefix_cache_skips_blocks_it_has() -> None:
    p, d = PrefillManager(32, B), DecodeManager(32, B)
    d.accept_handoff(prefilled(p, "a", prompt(1)), prompt(1))
    d.receive_done("a")
    p.transfer_done("a")
    d.free("a")
    h = prefilled(p, "b", prompt(2))
    admission = d.accept_handoff(h, prompt(2))
    assert len(admission.transfers) == 2  # the system prompt's 3 blocks are on the decode node already
    assert admission.transfers == tuple(zip(h.source_blocks[3:], list(admission.table)[3:], strict=True))
    assert admission.cached == h.cached == CachedTokens(device=12, num_prompt_tokens=17)  # warm on both: no delta


def test_decode_side_hits_count_only_beyond_the_prefill_report() -> None:
    p_cold, d = PrefillManager(32, B), DecodeManager(32, B)
    d.accept_handoff(prefilled(p_cold, "a", prompt(1)), prompt(1))
    d.receive_done("a")
    d.free("a")
    h = prefilled(p_cold, "b", prompt(1))  # p_cold still holds a: its report is 16
    other = PrefillManager(32, B)  # a prefill node where nothing is warm
    h_cold = prefilled(other, "c", prompt(1))
    assert h.cached.total == 16 and h_cold.cached.total == 0
    assert d.accept_handoff(h, prompt(1)).cached.total == 16  # delta 0, never negative
    d.receive_done("b")
    d.free("b")
    cold = d.accept_handoff(h_cold, prompt(1))
    assert cold.cached == CachedTokens(device=16, num_prompt_tokens=17)  # all of it found on decode
    assert d.decode_counters.decode_hit_tokens == 16 and d.decode_counters.seeded_hit_tokens == 16
    assert d.usage("c").openai() == {"prompt_tokens": 17, "prompt_tokens_details": {"cached_tokens": 16}}


@pytest.mark.parametrize("decode_cache", [True, False])
def test_a_prefix_warm_on_the_prefill_node_reports_the_same_number(decode_cache: bool) -> None:
    p, d = PrefillManager(32, B), DecodeManager(32, B, enable_prefix_caching=decode_cache)
    for i, tokens in enumerate([prompt(1), prompt(1), prompt(1) + [9, 9, 9]]):
        admission = d.accept_handoff(prefilled(p, i, tokens), tokens)
        d.receive_done(i)
        p.transfer_done(i)
        assert admission.cached.total == [0, 16, 16][i]
        assert d.usage(i).cached_tokens <= len(tokens)
        d.free(i)


def test_a_handoff_that_would_eat_the_reserve_is_refused_and_changes_nothing() -> None:
    p, d = PrefillManager(32, B), DecodeManager(11, B, reserve_blocks_per_sequence=2)
    d.accept_handoff(prefilled(p, "a", prompt(1)), prompt(1))  # 5 blocks; 6 free
    d.receive_done("a")
    other = list(range(2000, 2017))
    h = prefilled(p, "b", other)  # needs 5 blocks + 2 x 2 reserved = 9 > 6
    assert d.reserve_blocks == 2
    with assert_unchanged(d):
        assert d.accept_handoff(h, other) is None
    assert d.decode_counters.handoffs_refused == 1 and "b" not in d
    assert p.is_transferring("b")  # the prefill node keeps the blocks for a retry
    d.append_tokens("a", [1, 2, 3, 4])
    assert d.allocate("a", 4) is not None  # the reserve is there for the running sequence to grow
    d.free("a")
    assert d.accept_handoff(h, other) is not None


@pytest.mark.parametrize(
    "node",
    [
        {"hash_scheme": "sha256"},
        {"namespace": "another-model"},
        {"block_size": 8},
    ],
)
def test_handoffs_from_another_key_space_are_refused(node) -> None:
    p = PrefillManager(16, B)
    h = prefilled(p, "r", prompt(1))
    size = node.pop("block_size", B)
    d = DecodeManager(16, size, **node)
    with assert_unchanged(d), pytest.raises(HandoffError):
        d.accept_handoff(h, prompt(1))
    with pytest.raises(HandoffError):
        d.accept_handoff(dataclasses.replace(h, version=9), prompt(1))


def test_usage_needs_a_handed_off_sequence() -> None:
    d = DecodeManager(8, B)
    d.add_sequence("local", prompt(1))
    with pytest.raises(SequenceStateError):
        d.usage("local")
    with pytest.raises(UnknownSequenceError):
        d.usage("nobody")


# ---------------------------------------------------------------- state machine


class DisaggMachine(RuleBasedStateMachine):
    """Random interleavings on a prefill node and a decode node; both stay consistent after every step."""

    @initialize(decode_cache=st.booleans(), reserve=st.integers(0, 2))
    def setup(self, decode_cache: bool, reserve: int) -> None:
        self.p = PrefillManager(14, B)
        self.d = DecodeManager(14, B, reserve_blocks_per_sequence=reserve, enable_prefix_caching=decode_cache)
        self.tokens: dict[int, list[int]] = {}
        self.handoffs: dict[int, PrefillHandoff] = {}  # finished on P, not yet accepted by D
        self.moving: set[int] = set()  # accepted by D, transfer not done
        self.decoding: set[int] = set()
        self.reported: dict[int, int] = {}  # usage figure, frozen once the handoff was accepted
        self.next = 0

    @rule(tail=st.integers(0, 3), length=st.integers(1, 9))
    def admit_on_prefill(self, tail: int, length: int) -> None:
        if len(self.p._seqs) >= 3:
            return
        r = self.next
        self.next += 1
        self.tokens[r] = prompt(tail, length)
        self.p.add_sequence(r, self.tokens[r])
        self.p.allocate(r, len(self.tokens[r]) - self.p.lookup(r).device)

    def _pick(self, data, pool) -> int | None:
        choice = data.draw(st.integers(0, 7))
        items = sorted(pool)
        return items[choice % len(items)] if items else None

    @rule(data=st.data())
    def prefill_step(self, data) -> None:
        r = self._pick(data, [r for r in self.p._seqs if not self.p.is_transferring(r)])
        if r is None:
            return
        if not self.p.is_admitted(r):
            self.p.allocate(r, len(self.tokens[r]) - self.p.lookup(r).device)
        elif data.draw(st.booleans()):
            self.p.preempt(r)
        else:
            self.p.commit(r, len(self.tokens[r]))
            self.handoffs[r] = self.p.finish_prefill(r)

    @rule(data=st.data())
    def accept(self, data) -> None:
        r = self._pick(data, self.handoffs)
        if r is None:
            return
        held = self.handoffs[r].source_blocks
        admission = self.d.accept_handoff(PrefillHandoff.from_bytes(self.handoffs[r].to_bytes()), self.tokens[r])
        assert all(self.p.pool.ref_count(b) >= 1 for b in held)
        if admission is not None:
            del self.handoffs[r]
            self.moving.add(r)
            self.reported[r] = admission.cached.total

    @rule(data=st.data())
    def transfer(self, data) -> None:
        r = self._pick(data, self.moving)
        if r is None:
            return
        ok = data.draw(st.booleans()) or data.draw(st.booleans())
        self.d.receive_done(r, ok=ok)
        self.p.transfer_done(r)
        self.moving.discard(r)
        if ok:
            self.decoding.add(r)
        else:
            del self.reported[r]

    @rule(data=st.data())
    def decode(self, data) -> None:
        r = self._pick(data, self.decoding)
        if r is None:
            return
        d = self.d
        action = data.draw(st.sampled_from(["step", "preempt", "free"]))
        if action == "free":
            assert d.usage(r).cached_tokens == self.reported.pop(r)  # frozen since the handoff
            d.free(r)
            self.decoding.discard(r)
        elif not d.is_admitted(r):
            d.allocate(r, d.num_tokens(r) - d.lookup(r).device)
            if d.is_admitted(r):
                d.commit(r, d.num_tokens(r))
        elif action == "preempt":
            d.preempt(r)
        else:
            d.append_tokens(r, [7])
            if d.allocate(r, 1) is None:
                d.preempt(r)
            else:
                d.commit(r, d.num_tokens(r))

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "p"):
            return
        self.p.check_integrity()
        self.d.check_integrity()
        for r, handoff in self.handoffs.items():  # no prefill block freed before its transfer is done
            assert self.p.is_transferring(r)
            assert all(self.p.pool.ref_count(b) >= 1 for b in handoff.source_blocks)
        for r in self.moving:
            assert self.p.is_transferring(r) and self.d.is_receiving(r)
        for r in self.reported:
            usage = self.d.usage(r)
            assert 0 <= usage.cached_tokens <= len(self.tokens[r])
        counters = self.d.decode_counters
        assert counters.seeded_hit_tokens + counters.decode_hit_tokens >= sum(self.reported.values())


DisaggMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_disagg_state_machine = DisaggMachine.TestCase


def test_a_decode_node_also_keeps_the_configured_watermark() -> None:
    """reserved_blocks (the plain manager's watermark) holds for handoffs as well as admissions."""
    from kvblocks.config import CacheConfig
    from kvblocks.disagg import DisaggConfig

    p = PrefillManager(32, B)
    config = CacheConfig(num_blocks=12, block_size=B, reserved_blocks=2)
    d = DecodeManager.from_config(config, disagg=DisaggConfig(role="decode", reserve_blocks_per_sequence=1))
    h = prefilled(p, "a", prompt(1))  # 5 blocks
    d.accept_handoff(h, prompt(1))
    d.receive_done("a")  # 7 free
    other = list(range(2000, 2017))
    h2 = prefilled(p, "b", other)  # 5 blocks + 1 x 2 running + 2 watermark = 9 > 7
    with assert_unchanged(d):
        assert d.accept_handoff(h2, other) is None
    plain = DecodeManager.from_config(CacheConfig(num_blocks=12, block_size=B), disagg=DisaggConfig(role="decode"))
    plain.accept_handoff(prefilled(PrefillManager(32, B), "a", prompt(1)), prompt(1))
    plain.receive_done("a")
    assert plain.accept_handoff(prefilled(p, "c", other), other) is not None  # 5 + 2 <= 7 without the watermark
