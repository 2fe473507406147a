"""Fuzzing every decoder of bytes that come from outside the process (issue 12, item 3).

Event batches, prefill handoffs and storage entries arrive from other processes and
shared stores. Whatever the bytes -- random, or a valid encoding damaged at the byte
level or at the JSON level -- each decoder returns a value or raises its documented
error (:class:`EventDecodeError`, :class:`HandoffError`, a storage miss with a reason),
and the receiver it feeds (an :class:`EventConsumer` through ``pump``, a
:class:`DecodeManager`, a storage tier) is left as it was or changed only as documented.
A decoded value must also be re-encodable: the decoders accept nothing their encoders
would refuse.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvblocks import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeManager,
    DuplicateSequenceError,
    EventBatch,
    EventConsumer,
    HandoffError,
    PrefillHandoff,
    PrefillManager,
    decode_batch,
    encode_batch,
)
from kvblocks.errors import EventDecodeError
from kvblocks.events import EVENT_GROUP_KINDS
from kvblocks.events.transport import InProcessTransport, pump
from kvblocks.tiers import EntryFormat, MemoryStorage, StorageTier, TierConfig, block_key, namespace_tag
from kvblocks.tiers.entry import HEADER
from tests.support.mutations import JSON_VALUES, byte_mutations, handoffs, json_mutations

FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------- event batches

HASHES = st.one_of(
    st.lists(st.binary(min_size=16, max_size=16), max_size=4),
    st.lists(st.integers(0, 2**64 - 1), max_size=4),
)
PARENTS = st.one_of(st.none(), st.binary(min_size=16, max_size=16), st.integers(0, 2**64 - 1))
TIERS = st.sampled_from(["device", "host", "storage"])
# (group, kind): untagged (a single-group cache) or a group of a hybrid model's cache
GROUP_TAGS = st.one_of(
    st.just((None, None)),
    st.tuples(st.integers(0, 3) | st.integers(0, 2**63 - 1), st.sampled_from(EVENT_GROUP_KINDS)),
)
EVENTS = st.one_of(
    st.builds(
        lambda h, p, t, tok, g: BlockStored(tuple(h), p, t, tok, *g),
        HASHES,
        PARENTS,
        TIERS,
        st.none() | st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
        GROUP_TAGS,
    ),
    st.builds(lambda h, t, g: BlockRemoved(tuple(h), t, *g), HASHES, TIERS, GROUP_TAGS),
    st.builds(lambda t, g: AllBlocksCleared(t, *g), TIERS, GROUP_TAGS),
)
BATCHES = st.builds(
    EventBatch,
    st.text(min_size=1, max_size=8),
    st.integers(0, 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(EVENTS, max_size=3).map(tuple),
    st.booleans(),
)
VALID_BATCH_BYTES = BATCHES.map(encode_batch)


def _check_batch(data: Any) -> None:
    """``data`` decodes to a batch its encoder accepts and that survives a round trip, or raises EventDecodeError."""
    try:
        batch = decode_batch(data)
    except EventDecodeError:
        return
    assert decode_batch(encode_batch(batch)) == batch


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_are_a_batch_or_an_event_decode_error(data: bytes) -> None:
    _check_batch(data)


@FUZZ
@given(VALID_BATCH_BYTES.flatmap(byte_mutations))
def test_byte_damaged_batches_are_a_batch_or_an_event_decode_error(data: bytes) -> None:
    _check_batch(data)


@FUZZ
@given(VALID_BATCH_BYTES.flatmap(json_mutations))
def test_json_damaged_batches_are_a_batch_or_an_event_decode_error(data: bytes) -> None:
    _check_batch(data)


@SMALL
@given(BATCHES)
def test_every_valid_batch_tagged_or_not_round_trips(batch: EventBatch) -> None:
    assert decode_batch(encode_batch(batch)) == batch


GROUP_VALUES = st.one_of(
    st.integers(0, 2**63 - 1), st.sampled_from([0, 1, 2**63 - 1, 2**63, -1, True, False, 1.0, "1"]), JSON_VALUES
)
KIND_VALUES = st.one_of(
    st.sampled_from(EVENT_GROUP_KINDS), st.sampled_from(["Full", "full ", "window", "", 0]), JSON_VALUES
)
VALID_TAGS = st.fixed_dictionaries(
    {"group": st.integers(0, 2**63 - 1) | st.sampled_from([0, 2**63 - 1]), "kind": st.sampled_from(EVENT_GROUP_KINDS)}
)
TAGS = st.one_of(
    VALID_TAGS,
    st.tuples(VALID_TAGS, st.sampled_from(["group", "kind"]), GROUP_VALUES | KIND_VALUES).map(
        lambda t: {**t[0], t[1]: t[2]}  # one field replaced: often still valid, often just out of range
    ),
    st.tuples(VALID_TAGS, st.sampled_from(["group", "kind"])).map(
        lambda t: {k: v for k, v in t[0].items() if k != t[1]}
    ),
    st.tuples(VALID_TAGS, st.sampled_from(["x", "Group", ""]), JSON_VALUES).map(lambda t: {**t[0], t[1]: t[2]}),
    st.dictionaries(st.sampled_from(["group", "kind", "Group", "x", ""]), GROUP_VALUES | KIND_VALUES, max_size=3),
)


@FUZZ
@given(
    event=st.sampled_from([["S", "device", "2:0102", None], ["S", "device", [5], "09", [1]], ["R", "host", []]])
    | st.just(["C", "device"]),
    tag=TAGS,
)
def test_a_group_tag_decodes_to_a_valid_group_or_is_an_event_decode_error(event: list[Any], tag: Any) -> None:
    """Only ``{"group": int in 0..2**63-1, "kind": a known kind}`` or ``{"group": ...}`` alone (a foreign
    producer that names no kind) is a tag; anything else is refused."""
    data = json.dumps(
        {"version": 1, "producer": "w", "seq": 0, "ts": 0.0, "snapshot": False, "events": [event + [tag]]}
    )
    valid = (
        set(tag) in ({"group", "kind"}, {"group"})
        and type(tag["group"]) is int
        and 0 <= tag["group"] <= 2**63 - 1
        and tag.get("kind", "full") in EVENT_GROUP_KINDS
    )
    try:
        (decoded,) = decode_batch(data.encode()).events
    except EventDecodeError:
        assert not valid
        return
    assert valid and (decoded.group, decoded.group_kind) == (tag["group"], tag.get("kind"))
    assert json.loads(encode_batch(EventBatch("w", 0, 0.0, (decoded,))))["events"] == [event + [tag]]


def _consumer_state(c: EventConsumer) -> tuple[Any, ...]:
    return (
        {p: c.last_seq(p) for p in c.producers},
        c.needs_resync,
        (c.batches, c.gaps, c.duplicates, c.skipped, c.restarts, c.feed_errors),
    )


def _applying_consumer() -> tuple[EventConsumer, list[tuple[str, int]]]:
    seen: list[tuple[str, int]] = []
    consumer = EventConsumer(
        on_events=lambda p, e: seen.append((p, len(e))), on_snapshot=lambda p, e: seen.append((p, -len(e)))
    )
    return consumer, seen


@SMALL
@given(
    st.lists(
        st.one_of(
            st.integers(0, 3),  # batch k of producer "w" (valid)
            st.binary(max_size=64),
            VALID_BATCH_BYTES.flatmap(byte_mutations),
            VALID_BATCH_BYTES.flatmap(json_mutations),
        ),
        max_size=8,
    ),
    st.integers(1, 4),
)
def test_pump_feeds_exactly_what_decodes_and_survives_everything_else(items: list[Any], max_count: int) -> None:
    payloads = [
        encode_batch(EventBatch("w", item, 0.0, (AllBlocksCleared("device"),))) if isinstance(item, int) else item
        for item in items
    ]
    transport = InProcessTransport()
    for data in payloads:
        transport.send(data)
    consumer, seen = _applying_consumer()
    fed = pump(transport, consumer, max_count=max_count)
    reference, reference_seen = _applying_consumer()
    decodable = 0
    for data in payloads:
        try:
            batch = decode_batch(data)
        except EventDecodeError:
            continue
        decodable += 1
        reference.feed(batch)
    assert len(transport) == 0 and fed == decodable and consumer.malformed == len(payloads) - decodable
    assert _consumer_state(consumer) == _consumer_state(reference) and seen == reference_seen


@SMALL
@given(st.one_of(st.binary(max_size=64), VALID_BATCH_BYTES.flatmap(json_mutations)))
def test_an_undecodable_payload_leaves_the_consumer_as_it_was(data: bytes) -> None:
    try:
        decode_batch(data)
    except EventDecodeError:
        pass
    else:
        return  # a decodable payload may change the consumer: that is what it is for
    consumer, seen = _applying_consumer()
    transport = InProcessTransport()
    transport.send(encode_batch(EventBatch("w", 0, 0.0, ())))
    pump(transport, consumer)
    before, seen_before = _consumer_state(consumer), list(seen)
    transport.send(data)
    assert pump(transport, consumer) == 0
    assert _consumer_state(consumer) == before and seen == seen_before and consumer.malformed == 1


# ---------------------------------------------------------------------- prefill handoffs

BLOCK = 4


VALID_HANDOFF_BYTES = handoffs().map(lambda h: h.to_bytes())


def _check_handoff(data: Any) -> PrefillHandoff | None:
    try:
        handoff = PrefillHandoff.from_bytes(data)
    except HandoffError:
        return None
    assert PrefillHandoff.from_bytes(handoff.to_bytes()) == handoff
    return handoff


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_are_a_handoff_or_a_handoff_error(data: bytes) -> None:
    _check_handoff(data)


@FUZZ
@given(VALID_HANDOFF_BYTES.flatmap(byte_mutations))
def test_byte_damaged_handoffs_are_a_handoff_or_a_handoff_error(data: bytes) -> None:
    _check_handoff(data)


@FUZZ
@given(VALID_HANDOFF_BYTES.flatmap(json_mutations))
def test_json_damaged_handoffs_are_a_handoff_or_a_handoff_error(data: bytes) -> None:
    _check_handoff(data)


def _prefilled(seq_id: str, tokens: list[int]) -> bytes:
    p = PrefillManager(16, BLOCK)
    p.add_sequence(seq_id, tokens)
    p.allocate(seq_id, len(tokens))
    p.commit(seq_id, len(tokens))
    return p.finish_prefill(seq_id).to_bytes()


PROMPT = list(range(100, 111))  # 2 full blocks and a partial one
OTHER = list(range(200, 209))
REAL_HANDOFF = _prefilled("r", PROMPT)
OTHER_HANDOFF = _prefilled("o", OTHER)


def _decode_state(d: DecodeManager) -> tuple[Any, ...]:
    pool = d.pool
    return (
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        list(pool.fresh_order()),
        list(pool.idle_lru()),
        sorted(map(repr, d._seqs)),
        d.num_running,
        repr(d.decode_counters),
        d.stats,
    )


@SMALL
@given(st.one_of(byte_mutations(REAL_HANDOFF), json_mutations(REAL_HANDOFF)))
def test_a_damaged_handoff_is_refused_or_accepted_whole_by_a_decode_manager(data: bytes) -> None:
    d = DecodeManager(16, BLOCK, reserve_blocks_per_sequence=1)
    assert d.accept_handoff(PrefillHandoff.from_bytes(OTHER_HANDOFF), OTHER) is not None  # not an empty node
    before = _decode_state(d)
    try:
        handoff = PrefillHandoff.from_bytes(data)
        admission = d.accept_handoff(handoff, PROMPT)
    except (HandoffError, DuplicateSequenceError):
        assert _decode_state(d) == before
    else:  # accepted whole (every prompt block mapped), or refused for want of blocks (only counted)
        if admission is None:
            assert _decode_state(d)[:5] == before[:5]
        else:
            assert len(admission.table) == 3 and d.is_receiving(handoff.seq_id)
    d.check_integrity()


# ---------------------------------------------------------------------- storage entries

FORMAT = EntryFormat("xxh3-128", "bfloat16", (2, 2, 4, 2, 8), 0x1234, 64)
PAYLOAD = bytes(range(64))
STORED_HASH = b"\x42" * 16
KEY = block_key(namespace_tag("fuzz", "xxh3-128", BLOCK), "xxh3-128", STORED_HASH, format_tag=FORMAT.tag)
ENTRY = FORMAT.encode(PAYLOAD, KEY)  # bound to KEY: the storage tier below reads STORED_HASH under it
MISS_REASONS = {
    "absent",
    "truncated header",
    "bad magic",
    "other format version",
    "other scheme, dtype, shape or spec",
    "truncated payload",
    "overlong payload",
    "checksum mismatch",
    "not a byte string",
    "written under another key",
}


def _check_entry(data: Any) -> None:
    payload, reason = FORMAT.decode(data, KEY)
    if payload is None:
        assert reason in MISS_REASONS
    else:  # sound only if it is the entry (xxh3-64 collisions aside)
        assert reason == "" and bytes(data) == ENTRY and bytes(payload) == PAYLOAD


@FUZZ
@given(st.binary(max_size=2 * HEADER.size + 64) | st.binary(max_size=80).map(lambda tail: ENTRY[:40] + tail))
def test_random_bytes_are_a_storage_miss_with_a_reason(data: bytes) -> None:
    _check_entry(data)


@FUZZ
@given(byte_mutations(ENTRY))
def test_damaged_entries_are_misses_with_a_reason(data: bytes) -> None:
    _check_entry(data)


@pytest.mark.parametrize(
    "value",
    [
        memoryview(bytes(b for pair in zip(ENTRY, ENTRY) for b in pair))[::2],  # strided: equal to ENTRY
        memoryview(bytearray(ENTRY)).cast("B", (1, len(ENTRY))),
    ],
)
def test_a_non_contiguous_or_shaped_view_of_an_entry_decodes(value: memoryview) -> None:
    payload, reason = FORMAT.decode(value, KEY)
    assert reason == "" and payload is not None and bytes(payload) == PAYLOAD


@pytest.mark.parametrize("value", ["text", 12345, object(), [1, 2]])
def test_a_value_that_is_not_bytes_is_a_miss(value: Any) -> None:
    assert FORMAT.decode(value) == (None, "not a byte string")


@pytest.fixture(scope="module")
def storage_tier():
    backend = MemoryStorage()
    tier = StorageTier(TierConfig(storage=backend, entry_format=FORMAT), "fuzz", "xxh3-128", BLOCK)
    yield tier, backend
    tier.close()


_LOAD_COUNTERS = ("loads_hit", "loads_missing", "loads_corrupt", "loads_wrong_key")


@SMALL
@given(st.one_of(byte_mutations(ENTRY), st.binary(max_size=200)))
def test_a_damaged_stored_entry_is_one_counted_miss_never_a_failed_read(storage_tier, data: bytes) -> None:
    tier, backend = storage_tier
    h = STORED_HASH
    assert tier.keys_of(h) == [KEY]
    backend.put([(KEY, data)])
    before = tier.stats.snapshot()
    request = tier.load([h])
    assert tier.wait_idle(5.0)
    ((answered, outcome),) = tier.take_results()
    after = tier.stats
    assert answered == request and after.load_errors == before.load_errors
    changes = {name: getattr(after, name) - getattr(before, name) for name in _LOAD_COUNTERS}
    assert sum(changes.values()) == 1
    assert (changes["loads_hit"] == 1) == (data == ENTRY) == (len(outcome.payloads) == 1)
