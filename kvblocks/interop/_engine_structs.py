"""The msgspec structs of vLLM's and SGLang's KV event payloads, as :mod:`kvblocks.interop.engine_wire` reads
and writes them. Imported lazily by that module (it needs msgspec); written for kvblocks from the engines'
documented field lists, not copied.

Reading structs bound every value (a hash is an int or 1..64 bytes, token ids are below ``2**32``, sizes,
ids and ranks are in ``0..2**63-1``, strings are short) and default every field but ``block_hashes``, so a
producer that leaves one out is still read; unknown fields are skipped. Writing structs follow the engines'
field order and required fields, so the bytes are what the engines write.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Raw, Struct

MAX_HASH_BYTES = 64  # sha512, the widest digest an engine could publish
MAX_TEXT = 1024  # medium, kind and LoRA names are short identifiers

WireHash = int | Annotated[bytes, Meta(min_length=1, max_length=MAX_HASH_BYTES)]
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Token = Annotated[int, Meta(ge=0, lt=2**32)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]


# ---------------------------------------------------------------------- reading: vLLM >= 0.12, SGLang (maps)


class MapStored(Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None = None
    # SGLang's bigram pages are pairs. Not tuple[Token, Token]: msgspec 0.22 misreads (and may crash on) a
    # union of a constrained int and a fixed-length tuple.
    token_ids: list[Token | list[Token]] | None = None
    block_size: Count | None = None
    lora_id: Count | None = None
    medium: Text | None = None
    lora_name: Text | None = None
    group_idx: Count | None = None
    kv_cache_spec_kind: Text | None = None


class MapRemoved(Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[WireHash]
    medium: Text | None = None
    group_idx: Count | None = None


class MapCleared(Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


MapEvent = MapStored | MapRemoved | MapCleared


# ---------------------------------------------------------------------- reading: vLLM <= 0.11 (positional arrays)


class ArrayStored(Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None = None
    token_ids: list[Token | list[Token]] | None = None
    block_size: Count | None = None
    lora_id: Count | None = None
    medium: Text | None = None
    lora_name: Text | None = None


class ArrayRemoved(Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[WireHash]
    medium: Text | None = None


class ArrayCleared(Struct, array_like=True, tag="AllBlocksCleared"):
    pass


ArrayEvent = ArrayStored | ArrayRemoved | ArrayCleared


class ArrayBatch(Struct, array_like=True):
    """``[ts, events, rank]``: both engines' batch (each event left raw: it is a map or an array)."""

    ts: float
    events: list[Raw]
    rank: Count | None = None


class MapBatch(Struct):
    ts: float
    events: list[Raw]
    data_parallel_rank: Count | None = None
    attn_dp_rank: Count | None = None


# ---------------------------------------------------------------------- writing


class VllmStored(Struct, omit_defaults=True, tag_field="type", tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Every field of vLLM 0.33's BlockStored, in its order, even those kvblocks leaves unset: msgspec sizes a
    # map's header by the number of fields a struct has, so the same fields give the same bytes.
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmRemoved(Struct, omit_defaults=True, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class SglangStored(Struct, omit_defaults=True, tag_field="type", tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SglangRemoved(Struct, omit_defaults=True, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class Cleared(Struct, omit_defaults=True, tag_field="type", tag="AllBlocksCleared"):
    pass


class VllmBatch(Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class SglangBatch(Struct, array_like=True):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


DECODE_ERRORS: tuple[type[BaseException], ...] = (msgspec.DecodeError, RecursionError, ValueError, TypeError)
array_batch = msgspec.msgpack.Decoder(ArrayBatch)
map_batch = msgspec.msgpack.Decoder(MapBatch)
map_event = msgspec.msgpack.Decoder(MapEvent)
array_event = msgspec.msgpack.Decoder(ArrayEvent)
encoder = msgspec.msgpack.Encoder()
