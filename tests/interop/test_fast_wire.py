"""The ZMQ publisher's fast encoder (:func:`kvblocks.interop.fast_wire.encode_pending_events`) writes the bytes
of the reference path, for whatever a sink holds.

The oracle is the one of ``test_engine_wire_encoding``: the engine's structs, built from the field mapping
restated there, encoded by msgspec in one call. Entries are recorded into a real :class:`EventSink` the way
kvblocks' caches record them (``partial(stored_event, ...)`` with a list of hashes, a parent, an
``array('I')``'s bytes and a LoRA name; ``partial(stored_range_event, ...)`` with a sequence's hashes, a block
range and its token array; ``partial(removed_event, ...)``), beside built events (``emit``) and
entries of other factories. Token ids mostly in one msgpack size class (a vocabulary below 65536) take the
fast path's uint16 layout; others its general one; hashes cover digests whose int form is below ``2**32``.
"""

from __future__ import annotations

import itertools
from array import array
from functools import partial
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("msgspec")

from kvblocks.events import EventSink
from kvblocks.events.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PendingEvent,
    build_pending,
    removed_event,
    stored_event,
    stored_range_event,
)
from kvblocks.interop.engine_wire import encode_engine_events
from kvblocks.interop.fast_wire import encode_pending_events
from tests.support.engine_wire import (
    BAD_HASHES,
    ENCODE_ERRORS,
    INVALID,
    TOKEN_EDGES,
    any_hash,
    cleared_st,
    group_st,
    reference,
    removed_st,
    stored_st,
    text_st,
    tier_st,
)

COMBOS = list(itertools.product(("vllm", "sglang"), (True, False)))

# digests whose vLLM int form (the last 8 bytes) is below 2**32, or only looks it in one byte
low_word = st.builds(
    lambda a, b: a + bytes(4) + b, st.binary(min_size=8, max_size=8), st.binary(min_size=4, max_size=4)
)
zero_byte = st.builds(
    lambda a, b: a + b"\x00" + b, st.binary(min_size=8, max_size=8), st.binary(min_size=7, max_size=7)
)
digest16 = st.binary(min_size=16, max_size=16)
cache_hash = st.one_of(digest16, digest16, low_word, zero_byte, any_hash)
cache_hashes = st.one_of(
    st.lists(digest16, max_size=10),  # one width: the fast path's
    st.lists(cache_hash, max_size=6),
    st.sampled_from([8, 24, 32]).flatmap(lambda w: st.lists(st.binary(min_size=w, max_size=w), max_size=6)),
)
# a vocabulary below 65536 (uint16 ids), with a few small ones; or any ids
vocab_ids = st.lists(
    st.one_of(st.integers(256, 65535), st.integers(256, 65535), st.integers(256, 65535), st.sampled_from(TOKEN_EDGES)),
    max_size=48,
)
ids_st = st.one_of(vocab_ids, vocab_ids, st.lists(st.integers(0, 2**32 - 1), max_size=20), st.just([]))
# tags a cache uses, and a few it never does (which the reference writes)
size_st = st.none() | st.sampled_from([1, 16, 2**63 - 1]) | st.integers(0, 64)
odd_group = st.tuples(st.sampled_from([True, -1, 2**64]), st.sampled_from([None, "full"]))
tags_st = st.tuples(tier_st, st.one_of(group_st, group_st, odd_group), size_st)


@st.composite
def cache_stored(draw: st.DrawFn) -> tuple[Any, ...]:
    tier, (group, kind), size = draw(tags_st)
    factory = partial(stored_event, tier, group, kind, size)
    ids = draw(st.none() | ids_st.map(lambda t: array("I", t).tobytes()))
    lora = draw(text_st | st.text(min_size=20, max_size=300))  # fixstr, str8, str16
    return (factory, draw(cache_hashes), draw(st.none() | cache_hash), ids, lora)


@st.composite
def cache_stored_range(draw: st.DrawFn) -> tuple[Any, ...]:
    """A commit of a sequence whose hashes and tokens only grow: the range is read when encoded."""
    tier, (group, kind), size = draw(tags_st)
    factory = partial(stored_range_event, tier, group, kind, size)
    chain = draw(cache_hashes)
    stop = draw(st.integers(0, len(chain)))
    start = draw(st.integers(0, stop))
    tokens = draw(st.none() | ids_st.map(lambda t: array("I", t)))  # as long as the chain's tokens or not
    lora = draw(text_st | st.text(min_size=20, max_size=300))
    return (factory, chain, start, stop, tokens, lora)


@st.composite
def cache_removed(draw: st.DrawFn) -> tuple[Any, ...]:
    tier, (group, kind), _ = draw(tags_st)
    return (partial(removed_event, tier, group, kind), draw(cache_hashes))


built = st.one_of(stored_st(), removed_st(), cleared_st()).map(lambda e: ("emit", e))


class _Unhashable:
    """A factory that cannot be a dict key (``__eq__`` without ``__hash__``)."""

    def __eq__(self, other: object) -> bool:
        return self is other

    def __call__(self, tier: str) -> AllBlocksCleared:
        return AllBlocksCleared(tier)


other_factory = st.one_of(
    tier_st.map(lambda t: (AllBlocksCleared, t)),
    tier_st.map(lambda t: (_Unhashable(), t)),
    st.tuples(st.lists(digest16, max_size=3).map(tuple), tier_st).map(lambda a: (BlockRemoved, *a)),
)
recorded = st.lists(
    st.one_of(cache_stored(), cache_stored(), cache_stored_range(), cache_removed(), built, other_factory), max_size=24
)


def record(items: list[tuple[Any, ...]]) -> list[PendingEvent]:
    """The entries a sink holds after recording ``items`` as a cache (or an application) would."""
    sink = EventSink()
    for item in items:
        if item[0] == "emit":
            sink.emit(item[1])
        else:
            sink.record(*item)
    return sink._take()


def check(entries: list[PendingEvent], ts: float, rank: int | None) -> None:
    """The fast encoder's bytes are the reference path's and the oracle's; it refuses what the reference does."""
    events = list(build_pending(entries))
    for dialect, int_hashes in COMBOS:
        try:
            before = encode_engine_events(events, ts, dialect, int_hashes=int_hashes, dp_rank=rank)  # type: ignore[arg-type]
        except ENCODE_ERRORS:
            with pytest.raises(ENCODE_ERRORS):
                encode_pending_events(entries, ts, dialect, int_hashes=int_hashes, dp_rank=rank)  # type: ignore[arg-type]
            continue
        got = encode_pending_events(entries, ts, dialect, int_hashes=int_hashes, dp_rank=rank)  # type: ignore[arg-type]
        assert got == before == reference(events, ts, dialect, int_hashes, rank, False), (dialect, int_hashes)


@settings(max_examples=350, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(items=recorded, ts=st.floats(allow_nan=False, allow_infinity=False), rank=st.none() | st.integers(0, 64))
def test_recorded_entries_encode_to_the_reference_bytes(
    items: list[tuple[Any, ...]], ts: float, rank: int | None
) -> None:
    check(record(items), ts, rank)


def _vocab_batch(small_at: list[int], big: bool) -> list[PendingEvent]:
    """200 stored events of 16 uint16 ids each (a 3,200-id batch), ids below 256 at the positions given --
    the first and last of an event, runs, an event of small ids only -- and one id >= 65536 if ``big``."""
    ids = [300 + (k * 7919) % 65000 for k in range(3200)]
    for k, at in enumerate(small_at):
        ids[at] = TOKEN_EDGES[k % 5]  # 0, 1, 127, 128, 255
    if big:
        ids[1000] = 65536
    factory = partial(stored_event, "device", None, None, 16)
    sink = EventSink()
    for e in range(200):
        digests = [(e * 1000 + b).to_bytes(16, "big") for b in range(1)]
        parent = None if e % 3 == 0 else (e * 1000 - 1).to_bytes(16, "big")
        sink.record(factory, digests, parent, array("I", ids[16 * e : 16 * e + 16]).tobytes(), None if e % 5 else "l")
    return sink._take()


@pytest.mark.parametrize(
    ("small_at", "big"),
    [
        ([], False),
        ([0, 15, 16, 31, 32, 3199], False),  # at event edges and the batch's ends
        ([48 + k for k in range(16)] + [100, 101, 102], False),  # one event all small, a run
        (list(range(0, 3200, 17)), False),  # one in 17: still the uint16 layout
        (list(range(0, 3200, 9)), False),  # one in 9: the general path
        ([5, 77], True),  # an id >= 65536: the general path
        (list(range(0, 3200, 400)), True),
    ],
)
def test_a_vocabulary_batch_with_small_and_large_ids_matches(small_at: list[int], big: bool) -> None:
    check(_vocab_batch(small_at, big), 2.5, 1)


@pytest.mark.parametrize("name", sorted({**INVALID, **BAD_HASHES}))
def test_an_invalid_event_raises_what_the_reference_raises(name: str) -> None:
    """Built and as a cache's entry (where it can be one): never bytes where the reference refuses."""
    bad = {**INVALID, **BAD_HASHES}[name]
    good = BlockStored((b"\x02" * 16,), None, "device", (1, 2))
    items: list[list[tuple[Any, ...]]] = [[("emit", good), ("emit", bad)]]
    if isinstance(bad, BlockStored) and not isinstance(bad.token_ids, str):
        factory = partial(stored_event, bad.tier, bad.group, bad.group_kind, bad.block_size)
        try:
            ids = None if bad.token_ids is None else array("I", bad.token_ids).tobytes()
        except (OverflowError, TypeError):
            ids = None  # not an array('I'): the cache could not have recorded it
        items.append([(factory, list(bad.block_hashes), bad.parent_hash, ids, bad.lora_name)])
    for group in items:
        check(record(group), 1.0, None)


def test_arrays_of_65536_and_more_values_match() -> None:
    """Array headers past uint16 (``dd``): one event's 70,000 token ids and 66,000 hashes."""
    factory = partial(stored_event, "host", 0, "full", 1)
    ids = array("I", (256 + k % 60000 for k in range(70_000))).tobytes()
    digests = [(k + 1).to_bytes(16, "big") * 1 for k in range(66_000)]
    sink = EventSink()
    sink.record(factory, digests, None, ids, "x" * 70_000)
    sink.record(partial(removed_event, "host", 0, "full"), digests)
    check(sink._take(), 3.0, None)
