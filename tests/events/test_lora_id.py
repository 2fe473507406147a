"""The engine's integer LoRA id: carried by ``BlockExtras`` beside the adapter's name, published in
``BlockStored`` as vLLM's ``lora_id`` (on every wire path), and part of no hash."""

from __future__ import annotations

import pytest

from kvblocks import BlockExtras, BlockHasher, EventSink, KVCacheManager
from kvblocks.errors import ConfigError
from kvblocks.events import BlockStored
from kvblocks.hashing import HASH_SCHEMES
from kvblocks.interop.engine_wire import decode_engine_batch, encode_engine_events
from kvblocks.interop.fast_wire import encode_pending_events


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lora_id": 3}, "without lora"),
        ({"lora": "a", "lora_id": 0}, "lora_id must be an int >= 1"),
        ({"lora": "a", "lora_id": -2}, "lora_id must be an int >= 1"),
        ({"lora": "a", "lora_id": True}, "lora_id must be an int >= 1"),
        ({"lora": "a", "lora_id": "7"}, "lora_id must be an int >= 1"),
    ],
)
def test_a_bad_lora_id_is_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        BlockExtras(**kwargs)


@pytest.mark.parametrize("scheme", sorted(HASH_SCHEMES))
def test_the_id_is_part_of_no_hash(scheme: str) -> None:
    hasher = BlockHasher(4, scheme=scheme)
    path = {"lora_path": "/adapters/a"} if scheme.startswith("vllm") else {}  # vLLM keys LoRA by name and path
    named = BlockExtras(lora="a", **path)
    assert hasher.hash_tokens(range(12), BlockExtras(lora="a", lora_id=9, **path)) == hasher.hash_tokens(
        range(12), named
    )


def committed_events(extras: BlockExtras | None) -> list[BlockStored]:
    sink = EventSink()
    m = KVCacheManager(16, 4, event_sink=sink)
    m.add_sequence("a", list(range(9)), extras=extras)
    m.allocate("a", 9)
    m.commit("a", 9)
    m.append_tokens("a", [9, 10, 11])
    m.allocate("a", 3)
    m.commit("a", 12)
    return [r.event for r in sink.drain() if isinstance(r.event, BlockStored)]


def test_committed_blocks_publish_the_adapters_name_and_id() -> None:
    stored = committed_events(BlockExtras(lora="adapter-a", lora_id=7))
    assert len(stored) == 2 and all((e.lora_name, e.lora_id) == ("adapter-a", 7) for e in stored)
    assert all((e.lora_name, e.lora_id) == ("adapter-a", None) for e in committed_events(BlockExtras(lora="adapter-a")))
    assert all((e.lora_name, e.lora_id) == (None, None) for e in committed_events(None))


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_the_id_reaches_the_engine_wire_from_recorded_and_built_events(dialect: str) -> None:
    """The publisher's path (recorded entries) and the built events encode to the same bytes, and the
    decoded events carry the id."""
    pytest.importorskip("msgspec")
    sink = EventSink()
    m = KVCacheManager(16, 4, event_sink=sink)
    m.add_sequence("a", list(range(9)), extras=BlockExtras(lora="adapter-a", lora_id=7))
    m.allocate("a", 9)
    m.commit("a", 9)
    entries = sink._take()
    fast = encode_pending_events(entries, 1.5, dialect)
    built = committed_events(BlockExtras(lora="adapter-a", lora_id=7))[:1]
    assert fast == encode_engine_events(built, 1.5, dialect)
    (event,) = decode_engine_batch(fast, dialect).events
    assert isinstance(event, BlockStored) and event.lora_id == 7
