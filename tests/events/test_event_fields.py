"""vLLM's event fields in kvblocks' events: groups without a kind, and transports with a wire format of their own."""

from __future__ import annotations

from kvblocks.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventPublisher, EventSink
from kvblocks.routing import Router, RouterConfig


def _router() -> Router:
    return Router(["w"], RouterConfig(block_size=4))


def test_a_group_without_a_kind_counts_as_the_prefix_only_when_it_is_group_0() -> None:
    router = _router()
    router.apply_events("w", [BlockStored((1, 2), None, "device", None, 0), BlockStored((3,), 2, "device", None, 1)])
    assert router.overlaps([1, 2, 3]) == {"w": 2.0}
    # vLLM's BlockRemoved names only the group index: group 1's removal leaves group 0's copy in the index
    router.apply_events("w", [BlockRemoved((1,), "device", 1), AllBlocksCleared("device", 1)])
    assert router.overlaps([1, 2, 3]) == {"w": 2.0}
    router.apply_events("w", [BlockRemoved((2,), "device", 0)])
    assert router.overlaps([1, 2, 3]) == {"w": 1.0}


class _BatchTransport:
    """A transport that writes its own wire format: it gets the batches, not kvblocks' JSON."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []
        self.payloads: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.payloads.append(data)

    def send_batch(self, batch: EventBatch) -> None:
        self.batches.append(batch)

    def receive(self, max_count: int = 100, timeout_s: float = 0.0) -> list[bytes]:
        return []

    def close(self) -> None:
        pass


def test_a_transport_with_send_batch_gets_the_numbered_batches_and_sees_the_gaps() -> None:
    sink = EventSink(capacity=2)
    transport = _BatchTransport()
    publisher = EventPublisher("w", sink, transport, max_batch=1)
    sink.emit(BlockStored((1,), None, "device", (5, 6), block_size=2, lora_name="a"))
    assert publisher.publish() == 1
    for h in (2, 3, 4):  # the buffer holds 2: record 1 is lost
        sink.emit(BlockRemoved((h,), "host"))
    publisher.publish()
    assert transport.payloads == []
    assert [b.seq for b in transport.batches] == [0, 2, 3]  # batch 1 is the lost record's gap
    assert transport.batches[0].events == (BlockStored((1,), None, "device", (5, 6), block_size=2, lora_name="a"),)


def test_a_router_of_a_vllm_fleet_scores_prompts_in_the_64_bit_form_its_events_carry() -> None:
    from kvblocks.hashing import block_hashes, vllm_int_hash

    tokens = list(range(40))
    native = Router(["w"], RouterConfig(block_size=16))
    int_form = Router(["w"], RouterConfig(block_size=16, hash_form="vllm-int64"))
    digests = block_hashes(tokens, 16)
    assert native.prompt_hashes(tokens) == digests
    assert int_form.prompt_hashes(tokens) == [int.from_bytes(h[-8:], "big") for h in digests]
    ints = tuple(vllm_int_hash(h) for h in digests)
    for router in (native, int_form):
        router.apply_events("w", [BlockStored(ints, None, "device")])
    assert int_form.route(tokens).worker == "w" and int_form.overlaps(int_form.prompt_hashes(tokens)) == {"w": 2.0}
    assert native.overlaps(native.prompt_hashes(tokens)) == {}  # bytes digests never meet the int form


def test_an_unknown_hash_form_is_a_config_error() -> None:
    import pytest

    from kvblocks.errors import ConfigError

    with pytest.raises(ConfigError, match="hash_form"):
        RouterConfig(block_size=16, hash_form="int64")


def test_any_manager_snapshots_its_cache_for_a_publisher() -> None:
    from kvblocks import KVCacheManager
    from kvblocks.hashing import block_hashes

    m = KVCacheManager(num_blocks=8, block_size=2)
    m.add_sequence("a", [1, 2, 3, 4, 5])
    m.allocate("a", 5)
    m.commit("a", 5)
    assert m.snapshot_events() == [BlockStored(tuple(block_hashes([1, 2, 3, 4], 2)), None, "device", block_size=2)]


def test_token_ids_of_any_sequence_type_make_equal_events_and_a_cache_s_event_is_its_own_copy() -> None:
    from array import array

    from kvblocks import KVCacheManager

    assert BlockStored((1,), None, "device", array("I", [1, 2])) == BlockStored((1,), None, "device", (1, 2))
    assert hash(BlockStored((1,), None, "device", array("I", [1, 2]))) == hash(
        BlockStored((1,), None, "device", (1, 2))
    )
    assert BlockStored((1,), None, "device", (1, 2)) != BlockStored((1,), None, "device", (1, 3))
    assert BlockStored((1,), None, "device", ()) != BlockStored((1,), None, "device", None)
    sink = EventSink()
    m = KVCacheManager(num_blocks=8, block_size=2, event_sink=sink)
    m.add_sequence("a", [1, 2, 3])
    m.allocate("a", 3)
    m.commit("a", 3)
    (record,) = sink.drain()
    m.append_tokens("a", [4, 5, 6])  # the sequence's tokens grow; the event already emitted does not
    assert list(record.event.token_ids) == [1, 2]


def test_a_tree_s_event_keeps_token_ids_of_any_array_width() -> None:
    """The tree hands a 32-bit array's tokens over as its bytes; any other array must not be read as one."""
    from array import array

    from kvblocks.pool import BlockPool
    from kvblocks.radix import PrefixTree

    for typecode in ("I", "Q", "H"):
        sink = EventSink()
        pool = BlockPool(4)
        tree = PrefixTree(pool, events=sink, block_size=2)
        blocks = pool.take_fresh(2)
        tree.insert([b"h0", b"h1"], blocks, tokens=array(typecode, [7, 300, 9, 65535]))
        (record,) = sink.drain()
        assert list(record.event.token_ids) == [7, 300, 9, 65535], typecode


def test_a_commit_s_event_built_late_names_what_was_committed_even_after_the_sequence_took_tokens_back() -> None:
    """The device tree records a commit as a range of the sequence's own hashes and tokens, read when the
    event is built; taking tokens back replaces those lists instead of cutting them, so a later append
    never shows through an event recorded before it."""
    from kvblocks import KVCacheManager
    from kvblocks.hashing import HashedTokens, block_hashes

    sink = EventSink()
    m = KVCacheManager(num_blocks=8, block_size=2, event_sink=sink)
    m.add_sequence("a", [1, 2, 3, 4, 5])
    m.allocate("a", 5)
    m.commit("a", 4)  # blocks [1, 2] and [3, 4]: one event, not built yet
    content = m._seqs["a"].content  # package-private: the sequence's own lists
    assert isinstance(content, HashedTokens)
    content.truncate(2)  # below the commit: only a caller of HashedTokens itself can do this
    content.extend([7, 7, 8])
    assert content.token_ids == (1, 2, 7, 7, 8) and content.hashes == block_hashes([1, 2, 7, 7], 2)
    (record,) = sink.drain()
    assert record.event == BlockStored(tuple(block_hashes([1, 2, 3, 4], 2)), None, "device", (1, 2, 3, 4), block_size=2)
