"""The engine wire's oracle and strategies, shared by the encoder tests (test_engine_wire_encoding, test_fast_wire).

The reference restates the field mapping of :mod:`kvblocks.interop.engine_wire` from the module's docstring and
tables -- written here, not imported -- and builds the engine's own structs
(:mod:`kvblocks.interop._engine_structs`), which msgspec encodes in one call.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import strategies as st

msgspec = pytest.importorskip("msgspec")

from kvblocks.errors import InvalidArgumentError, InvalidBlockHashError, InvalidTokenError  # noqa: E402
from kvblocks.events.codec import (  # noqa: E402
    EVENT_GROUP_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)
from kvblocks.interop import _engine_structs as S  # noqa: E402

U64 = 2**64 - 1
ENCODE_ERRORS = (InvalidArgumentError, InvalidTokenError, InvalidBlockHashError)


MEDIUM = {
    "vllm": {"device": "GPU", "host": "CPU", "storage": "STORAGE"},
    "sglang": {"device": "GPU", "host": "CPU_PINNED", "storage": "DISK"},
}
SPEC_KIND = {
    "full": "full_attention",
    "sliding_window": "sliding_window",
    "chunked_local": "chunked_local_attention",
    "recurrent": "mamba",
    "cross_attention": "cross_attention",
}


def ref_hash(h: int | bytes, dialect: str, int_hashes: bool) -> int | bytes:
    """vLLM: the digest's last 8 bytes, unsigned (or the bytes themselves); SGLang: its first 8, signed."""
    if dialect == "sglang":
        value = h & U64 if isinstance(h, int) else int.from_bytes(h[:8], "big")
        return value - 2**64 if value >= 2**63 else value
    if isinstance(h, int):
        return h & U64
    return int.from_bytes(h[-8:], "big") if int_hashes else h


def ref_scored(event: BlockStored | BlockRemoved) -> bool:
    """What SGLang's group-less dialect keeps: untagged, group 0 with no kind, or a full-attention group."""
    return event.group_kind == "full" or (event.group_kind is None and event.group in (None, 0))


def ref_struct(event: BlockStored | BlockRemoved, dialect: str, int_hashes: bool) -> Any:
    hashes = [ref_hash(h, dialect, int_hashes) for h in event.block_hashes]
    medium = MEDIUM[dialect].get(event.tier, event.tier)
    if isinstance(event, BlockRemoved):
        if dialect == "sglang":
            return S.SglangRemoved(hashes, medium)
        return S.VllmRemoved(hashes, medium, group_idx=event.group)
    parent = None if event.parent_hash is None else ref_hash(event.parent_hash, dialect, int_hashes)
    tokens = [] if event.token_ids is None else [int(t) for t in event.token_ids]
    size = event.block_size or 0
    if dialect == "sglang":
        return S.SglangStored(hashes, parent, tokens, size, event.lora_id, medium=medium, lora_name=event.lora_name)
    kind = None if event.group_kind is None else SPEC_KIND.get(event.group_kind)
    return S.VllmStored(
        hashes,
        parent,
        tokens,
        size,
        event.lora_id,
        medium,
        event.lora_name,
        group_idx=event.group,
        kv_cache_spec_kind=kind,
    )


def reference(
    events: Iterable[KVEvent], ts: float, dialect: str, int_hashes: bool, dp_rank: int | None, snapshot: bool
) -> bytes:
    """The whole batch as the engine's structs, encoded by msgspec in one call."""
    todo: list[KVEvent] = list(events)
    if snapshot:
        todo.insert(0, AllBlocksCleared("device"))
    if dialect == "sglang":
        todo = [e for e in todo if isinstance(e, AllBlocksCleared) or ref_scored(e)]
    out: list[Any] = []
    for e in todo:
        if isinstance(e, AllBlocksCleared):
            if not out or not isinstance(out[-1], S.Cleared):  # a run of clears is one engine clear
                out.append(S.Cleared())
        else:
            out.append(ref_struct(e, dialect, int_hashes))
    batch = S.VllmBatch(float(ts), out, dp_rank) if dialect == "vllm" else S.SglangBatch(float(ts), out, dp_rank)
    data: bytes = msgspec.msgpack.Encoder().encode(batch)
    return data


TOKEN_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**31, 2**32 - 1]
tokens_st = st.lists(st.one_of(st.sampled_from(TOKEN_EDGES), st.integers(0, 2**32 - 1)), max_size=40)
token_ids_st = st.one_of(
    st.none(),
    st.just(()),
    tokens_st.map(tuple),
    tokens_st,
    tokens_st.map(lambda t: array("I", t)),
    tokens_st.map(lambda t: array("Q", t)),
)
any_hash = st.one_of(
    st.binary(min_size=16, max_size=16),
    st.binary(min_size=32, max_size=32),
    st.binary(min_size=1, max_size=64),
    st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**127]),
    st.integers(0, 2**128),
)
hash_lists = st.one_of(
    st.sampled_from([8, 16, 24, 32]).flatmap(lambda w: st.lists(st.binary(min_size=w, max_size=w), max_size=8)),
    st.lists(any_hash, max_size=8),  # widths and forms mixed within one event
)
group_st = st.one_of(
    st.just((None, None)),
    st.tuples(st.sampled_from([0, 1, 2**63 - 1]) | st.integers(0, 20), st.sampled_from(EVENT_GROUP_KINDS)),
    st.tuples(st.integers(0, 3), st.none()),  # a foreign producer's group without a kind
)
tier_st = st.sampled_from(["device", "host", "storage", "dram"])
count_st = st.none() | st.sampled_from([0, 1, 2**63 - 1]) | st.integers(0, 2**20)
text_st = st.none() | st.text(max_size=12)


@st.composite
def stored_st(draw: st.DrawFn) -> BlockStored:
    group, kind = draw(group_st)
    return BlockStored(
        tuple(draw(hash_lists)),
        draw(st.none() | any_hash),
        draw(tier_st),
        draw(token_ids_st),
        group,
        kind,
        draw(st.none() | st.integers(1, 2**20)),
        draw(count_st),
        draw(text_st),
    )


@st.composite
def removed_st(draw: st.DrawFn) -> BlockRemoved:
    group, kind = draw(group_st)
    return BlockRemoved(tuple(draw(hash_lists)), draw(tier_st), group, kind)


@st.composite
def cleared_st(draw: st.DrawFn) -> AllBlocksCleared:
    group, kind = draw(group_st)
    return AllBlocksCleared(draw(tier_st), group, kind)


INVALID = {
    "token id 2**32": BlockStored((1,), None, "device", (5, 2**32)),
    "negative token id": BlockStored((1,), None, "device", [0, -1]),
    "bool token id": BlockStored((1,), None, "device", (True,)),
    "float token id": BlockStored((1,), None, "device", (1.0,)),
    "str as token ids": BlockStored((1,), None, "device", "ab"),
    "signed array token ids": BlockStored((1,), None, "device", array("q", [3, -1])),
    "negative hash": BlockStored((b"\x01" * 16, -1), None, "device"),
    "negative removed hash": BlockRemoved((-(2**63),), "host"),
    "negative parent": BlockStored((1,), -5, "device"),
    "lora id beyond 64 bits": BlockStored((1,), None, "device", lora_id=2**64),
    "non-event None": None,
    "non-event int": 1,
    "non-event str": "BlockStored",
    "non-event batch": EventBatch("p", 0, 0.0, ()),
}
# Hashes that are neither an int >= 0 nor non-empty bytes: refused when converted to an int form
BAD_HASHES = {
    "empty bytes hash": BlockStored((b"",), None, "device"),
    "str hash": BlockStored(("ab",), None, "device"),
    "float hash": BlockRemoved((1.5,), "device"),
    "None hash": BlockStored((None,), None, "device"),  # type: ignore[arg-type]
    "bool hash": BlockRemoved((True,), "device"),
    "bytearray hash": BlockStored((bytearray(b"ab"),), None, "device"),  # type: ignore[arg-type]
    "str parent": BlockStored((1,), "x", "device"),
}
