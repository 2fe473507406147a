"""sglang-sha256: SGLang 0.5.23's page hashes, checked against what its own code published, and restated."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.errors import ConfigError, InvalidTokenError
from kvblocks.hashing import (
    BlockExtras,
    BlockHasher,
    HashedTokens,
    MultimodalItem,
    Namespace,
    block_hashes,
    sglang_int_hash,
)

STREAM = json.loads((Path(__file__).parents[1] / "data" / "sglang_event_stream.json").read_text())


def _published() -> dict[tuple[int, ...], list[int]]:
    """Token pages -> the signed hashes SGLang's own get_hash_str + hash_str_to_int64 put in its events."""
    size = STREAM["block_size"]
    out: dict[tuple[int, ...], list[int]] = {}
    for batch in STREAM["workers"][0]["script"]:
        for event in batch:
            tokens = event.get("token_ids") or []
            if event["type"] == "BlockStored" and tokens and all(type(t) is int for t in tokens):
                out[tuple(tokens)] = event["block_hashes"]
                assert len(tokens) == size * len(event["block_hashes"])
    return out


def test_kvblocks_reproduces_the_hashes_sglang_published() -> None:
    prompts = STREAM["prompts"]
    size = STREAM["block_size"]
    ours = {name: block_hashes(tokens, size, scheme="sglang-sha256") for name, tokens in prompts.items()}
    signed = {name: [int.from_bytes(h[:8], "big", signed=True) for h in hashes] for name, hashes in ours.items()}
    published = _published()
    assert published[tuple(prompts["A"])] == signed["A"]
    assert published[tuple(prompts["B"][8:])] == signed["B"][2:]  # B's two new pages, after A's shared two
    assert published[tuple(prompts["E"][:4])] == signed["E"][:1]
    assert published[tuple(prompts["E"][4:])] == signed["E"][1:]
    # the wire codec reads a signed hash as the same bits unsigned: sglang_int_hash of the digest
    assert [h & (2**64 - 1) for h in signed["A"]] == [sglang_int_hash(h) for h in ours["A"]]


def test_a_kvblocks_node_publishes_in_sglangs_dialect_the_hashes_sglang_published() -> None:
    """An SGLang-format consumer must read a kvblocks node's page as SGLang's own: the first 8 bytes, signed."""
    pytest.importorskip("msgspec")
    import msgspec

    from kvblocks.events.codec import BlockStored, EventBatch
    from kvblocks.interop.engine_wire import encode_engine_batch

    tokens = STREAM["prompts"]["A"]
    size = STREAM["block_size"]
    ours = block_hashes(tokens, size, scheme="sglang-sha256")
    event = BlockStored(tuple(ours), None, "device", tuple(tokens), block_size=size)
    payload = encode_engine_batch(EventBatch("w", 0, 1.0, (event,)), "sglang", int_hashes=False)
    _, events, _ = msgspec.msgpack.decode(payload)
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert len(stored) == 1 and stored[0]["block_hashes"] == _published()[tuple(tokens)]


def _restated(tokens: list[int], size: int) -> list[bytes]:
    out, prior = [], b""
    for k in range(len(tokens) // size):
        prior = hashlib.sha256(prior + struct.pack(f"<{size}I", *tokens[k * size : (k + 1) * size])).digest()
        out.append(prior)
    return out


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    size=st.integers(1, 17),
    cut=st.integers(0, 80),
)
def test_the_scheme_is_sglangs_chain_one_shot_and_piecewise(tokens: list[int], size: int, cut: int) -> None:
    expected = _restated(tokens, size)
    assert block_hashes(tokens, size, scheme="sglang-sha256") == expected
    content = HashedTokens(BlockHasher(size, "sglang-sha256"), tokens[:cut])
    content.extend(tokens[cut:])
    assert content.hashes == expected


def test_a_lora_leaves_sglangs_event_hashes_and_what_it_cannot_express_is_refused() -> None:
    tokens = list(range(16))
    assert block_hashes(tokens, 4, scheme="sglang-sha256", extras=BlockExtras(lora="sql")) == _restated(tokens, 4)
    for extras in (BlockExtras(cache_salt="t"), BlockExtras(mm_items=(MultimodalItem("img", 0, 2),))):
        with pytest.raises(ConfigError):
            block_hashes(tokens, 4, scheme="sglang-sha256", extras=extras)
    with pytest.raises(ConfigError):
        BlockHasher(4, "sglang-sha256", Namespace(salt="s"))
    assert BlockHasher(4, "sglang-sha256", "llama").hash_tokens(tokens) == _restated(tokens, 4)  # no model in it
    with pytest.raises(InvalidTokenError):
        block_hashes([2**32], 1, scheme="sglang-sha256")
