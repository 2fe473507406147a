"""The engine wire's encoder against an oracle: the bytes msgspec writes for the whole batch at once.

:func:`kvblocks.interop.engine_wire.encode_engine_events` writes a payload one event at a time (and may take
shortcuts: hashes converted in bulk, token ids written without int objects). Its contract is that the bytes
are IDENTICAL to those of the engine's own structs (:mod:`kvblocks.interop._engine_structs`) encoded in one
``msgspec.msgpack.Encoder().encode`` call. The reference (tests/support/engine_wire.py) restates the field
mapping from the module's docstring and tables -- written there, not imported -- and builds those structs;
hypothesis then compares the two on random batches, both dialects, both hash forms, with and without a
data-parallel rank.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

msgspec = pytest.importorskip("msgspec")

from kvblocks.events.codec import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)
from kvblocks.interop.engine_wire import encode_engine_batch, encode_engine_events  # noqa: E402
from tests.support.engine_wire import (  # noqa: E402
    BAD_HASHES,
    ENCODE_ERRORS,
    INVALID,
    TOKEN_EDGES,
    cleared_st,
    hash_lists,
    reference,
    removed_st,
    stored_st,
    tokens_st,
)

# ---------------------------------------------------------------------- the reference (tests/support/engine_wire.py)


def test_the_reference_writes_what_a_vllm_consumer_reads() -> None:
    """The oracle itself, on one event, against the field list of vLLM's KVEventBatch (no kvblocks code)."""
    e = BlockStored((b"\x01" * 8 + b"\x00" * 7 + b"\x05",), 7, "host", (1, 2), 3, "sliding_window", 2, None, "x")
    assert msgspec.msgpack.decode(reference([e], 1.5, "vllm", True, None, True)) == [
        1.5,
        [
            {"type": "AllBlocksCleared"},
            {
                "type": "BlockStored",
                "block_hashes": [5],
                "parent_block_hash": 7,
                "token_ids": [1, 2],
                "block_size": 2,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": "x",
                "group_idx": 3,
                "kv_cache_spec_kind": "sliding_window",
            },
        ],
        None,  # msgspec writes a None rank of an array_like struct (omit_defaults skips only map fields)
    ]
    sg = msgspec.msgpack.decode(reference([e, BlockRemoved((2**64 - 1,), "storage")], 2.0, "sglang", True, 4, False))
    assert sg == [2.0, [{"type": "BlockRemoved", "block_hashes": [-1], "medium": "DISK"}], 4]  # group 3: dropped
    assert reference([], 0.0, "sglang", True, None, False) == b"\x93\xcb" + bytes(8) + b"\x90\xc0"


# ---------------------------------------------------------------------- random batches


events_st = st.lists(st.one_of(stored_st(), removed_st(), cleared_st()), max_size=20)
ts_st = st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**53), 2**53)
rank_st = st.sampled_from([0, 1, 2**63 - 1]) | st.integers(0, 64)


def _dialect_ranks(dp_rank: int) -> Iterator[tuple[str, bool, int | None]]:
    """Every dialect and hash form, with ``dp_rank`` and with no rank (msgspec writes vLLM's as nil too: its
    ``omit_defaults`` does not apply to ``array_like`` structs, msgspec issue #720)."""
    yield from itertools.product(("vllm", "sglang"), (True, False), (dp_rank, None))


def check(
    events: list[KVEvent],
    ts: float,
    dialect: str,
    int_hashes: bool,
    rank: int | None,
    snapshot: bool,
    *,
    all_forms: bool = True,
    label: str = "",
) -> None:
    expected = reference(events, ts, dialect, int_hashes, rank, snapshot)
    got = encode_engine_events(events, ts, dialect, int_hashes=int_hashes, dp_rank=rank, snapshot=snapshot)  # type: ignore[arg-type]
    assert got == expected, (label, dialect, int_hashes, rank, snapshot)
    if not all_forms:
        return
    # a generator (what a publisher thread hands it) and the batch form give the same bytes
    lazy = encode_engine_events(iter(events), ts, dialect, int_hashes=int_hashes, dp_rank=rank, snapshot=snapshot)  # type: ignore[arg-type]
    batch = EventBatch("w", 3, ts, tuple(events), snapshot)
    assert lazy == expected == encode_engine_batch(batch, dialect, int_hashes=int_hashes, dp_rank=rank)  # type: ignore[arg-type]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=events_st, ts=ts_st, dp_rank=rank_st, snapshot=st.booleans())
def test_random_batches_are_the_bytes_msgspec_writes_for_the_whole_batch(
    events: list[KVEvent], ts: float, dp_rank: int, snapshot: bool
) -> None:
    for dialect, int_hashes, rank in _dialect_ranks(dp_rank):
        check(events, ts, dialect, int_hashes, rank, snapshot)


# ---------------------------------------------------------------------- sizes: array headers, long token runs


def _removed(k: int, group: int | None = None, kind: str | None = None) -> BlockRemoved:
    return BlockRemoved((k,), "device", group, kind)


def _sized_batches() -> Iterator[tuple[str, list[KVEvent]]]:
    for n in (0, 1, 15, 16, 17, 65535, 65536, 70000):
        yield f"{n} events", [_removed(k) for k in range(n)]
    # SGLang drops unscored events and both dialects collapse runs of clears: the header counts what is written
    yield "16 events, one unscored", [_removed(k) for k in range(15)] + [_removed(99, 1, "sliding_window")]
    yield "17 events, clears collapse to 15", [AllBlocksCleared("host")] * 3 + [_removed(k) for k in range(14)]
    clears = [e for k in range(8) for e in (AllBlocksCleared("device"), _removed(k, 1, "recurrent"))]
    yield "alternating clears around unscored events", clears + [_removed(k) for k in range(16)]


@pytest.mark.parametrize("snapshot", [False, True])
def test_array_headers_of_every_size_match(snapshot: bool) -> None:
    for name, events in _sized_batches():
        combos = list(_dialect_ranks(5))
        for dialect, int_hashes, rank in combos if len(events) < 1000 else combos[:: len(combos) - 1]:
            check(events, 7.25, dialect, int_hashes, rank, snapshot, all_forms=len(events) < 1000, label=name)


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_a_batch_with_more_than_100k_token_ids_matches(dialect: str) -> None:
    big = array("I", (t * 2654435761 % 2**32 for t in range(120_000)))
    big[:8] = array("I", TOKEN_EDGES[:8])
    events: list[KVEvent] = [
        BlockStored(tuple(k.to_bytes(32, "big") for k in range(1, 7501)), None, "device", big, None, None, 16),
        BlockStored((b"\xff" * 16,), b"\x07" * 16, "host", tuple(range(60_000)), block_size=60_000, lora_name="l"),
        BlockStored((3,), 2, "device", [2**32 - 1] * 50_000, 0, "full", 50_000, 7),
    ]
    for int_hashes in (True, False):
        expected = reference(events, 1.0, dialect, int_hashes, 0, False)
        assert encode_engine_events(events, 1.0, dialect, int_hashes=int_hashes, dp_rank=0) == expected  # type: ignore[arg-type]


# ---------------------------------------------------------------------- invalid events


def _combos() -> Iterator[Any]:
    for name, event in {**INVALID, **BAD_HASHES}.items():
        for dialect, int_hashes in (("vllm", True), ("vllm", False), ("sglang", True), ("sglang", False)):
            yield pytest.param(event, dialect, int_hashes, id=f"{name}-{dialect}-{int_hashes}")


@pytest.mark.parametrize(("event", "dialect", "int_hashes"), list(_combos()))
def test_an_invalid_event_raises_a_kvblocks_error_and_nothing_else(event: Any, dialect: str, int_hashes: bool) -> None:
    good = BlockStored((b"\x02" * 16,), None, "device", (1, 2))
    for events in ([event], [good, event, good], [AllBlocksCleared("device"), good, event]):
        with pytest.raises(ENCODE_ERRORS):
            encode_engine_events(events, 1.0, dialect, int_hashes=int_hashes)  # type: ignore[arg-type]
        with pytest.raises(ENCODE_ERRORS):
            encode_engine_events(iter(events), 1.0, dialect, int_hashes=int_hashes, snapshot=True)  # type: ignore[arg-type]


bad_token = st.one_of(
    st.integers(2**32, 2**70), st.integers(-(2**70), -1), st.booleans(), st.floats(), st.text(max_size=2), st.none()
)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), dialect=st.sampled_from(["vllm", "sglang"]), int_hashes=st.booleans())
def test_random_invalid_tokens_and_int_hashes_raise_only_kvblocks_errors(
    data: st.DataObject, dialect: str, int_hashes: bool
) -> None:
    events: list[Any] = data.draw(events_st, label="valid")
    tokens = data.draw(tokens_st, label="tokens")
    at = data.draw(st.integers(0, len(tokens)))
    bad_tokens = [*tokens[:at], data.draw(bad_token, label="bad"), *tokens[at:]]
    bad_hash = data.draw(st.integers(-(2**80), -1), label="bad hash")
    where = data.draw(st.sampled_from(["token", "hash", "parent", "removed", "object"]))
    if where == "token":
        bad: Any = BlockStored((1,), None, "device", data.draw(st.sampled_from([tuple, list]))(bad_tokens))
    elif where == "hash":
        bad = BlockStored((*data.draw(hash_lists), bad_hash), None, "host")
    elif where == "parent":
        bad = BlockStored((b"\x01" * 32,), bad_hash, "device")
    elif where == "removed":
        bad = BlockRemoved((bad_hash,), "storage")
    else:
        bad = data.draw(st.one_of(st.none(), st.integers(), st.text(), st.just(object()), st.tuples(st.integers())))
    events.insert(data.draw(st.integers(0, len(events))), bad)
    with pytest.raises(ENCODE_ERRORS):
        encode_engine_events(events, 0.5, dialect, int_hashes=int_hashes)  # type: ignore[arg-type]
