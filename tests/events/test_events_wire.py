"""KV events across processes: batches on the wire, publisher numbering, consumer gaps and resyncs.

The consumer side plays a router: a strict index (hash -> parent hash) per producer,
maintained only through ``on_events`` / ``on_snapshot``. Storing a hash twice, storing
under an unknown parent or removing an unknown hash raises -- so a batch applied twice,
out of order or after a loss the consumer failed to notice breaks the tests.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvblocks import AllBlocksCleared, BlockRemoved, BlockStored, EventSink, PrefixTree
from kvblocks.errors import (
    ConfigError,
    EventDecodeError,
    InvalidArgumentError,
    KVBlocksError,
)
from kvblocks.events import (
    EVENT_FORMAT_VERSION,
    EventBatch,
    EventConsumer,
    EventPublisher,
    decode_batch,
    encode_batch,
)
from kvblocks.events.transport import EventTransport, InProcessTransport, pump
from tests.support.event_index import Index, Workload, apply_events, tree_view

# ---------------------------------------------------------------------- helpers (shared: tests/support/event_index.py)


def stored(*hashes, parent=None, tier: str = "device", tokens=None, group=None, kind=None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tier, tokens, group, kind)


H16 = [bytes([k]) * 16 for k in range(1, 6)]


# ---------------------------------------------------------------------- wire format


@pytest.mark.parametrize(
    "events",
    [
        (stored(*H16[:3]),),
        (stored(H16[3], parent=H16[2], tokens=(1, 2, 0, 4294967295)),),
        (stored(1, 2**64 - 1, parent=0), stored(2**127, parent=2**64 - 1, tokens=())),
        (BlockRemoved((H16[4], H16[0]), "device"), BlockRemoved((7,), "host"), AllBlocksCleared("device")),
        (stored(b"\x01\x02", b"\x03", parent=b"\xff" * 32),),  # widths differ within one event: still exact
        (stored(b"ab", 5, parent=3, tier="dram"), BlockRemoved((), "device")),
        (stored(b"\x00" * 16, parent=None, tier='t\u00e9r "x"'),),
        (),
        # tagged: the groups of a hybrid model's cache
        (stored(*H16[:2], group=0, kind="full"), stored(H16[2], parent=H16[1], group=1, kind="sliding_window")),
        (stored(H16[3], parent=H16[2], tokens=(7, 8), group=2**63 - 1, kind="chunked_local"),),
        (stored(5, parent=None, tokens=(), group=3, kind="recurrent"), stored(6, group=4, kind="cross_attention")),
        (BlockRemoved((H16[0],), "device", 1, "sliding_window"), BlockRemoved((), "host", 0, "full")),
        (AllBlocksCleared("device", 2, "chunked_local"), AllBlocksCleared("device"), BlockRemoved((H16[1],), "device")),
        # vLLM's fields: block size, LoRA, a group whose producer named no kind
        (BlockStored((H16[0], H16[1]), None, "host", (1, 2, 3, 4), block_size=2, lora_id=3, lora_name="sql-lora"),),
        (BlockStored((H16[0],), None, "device", None, 1, None, block_size=16), BlockRemoved((H16[0],), "device", 1)),
        (BlockStored((9,), 8, "storage", lora_name="\u00e9", lora_id=2**63 - 1), AllBlocksCleared("device", 0)),
    ],
)
@pytest.mark.parametrize("snapshot", [False, True])
def test_every_event_type_round_trips_through_bytes(events, snapshot) -> None:
    batch = EventBatch("worker-\u00e9-1", 41, 1712345678.125, events, snapshot)
    data = encode_batch(batch)
    assert isinstance(data, bytes)
    back = decode_batch(data)
    assert back == batch
    for original, decoded in zip(batch.events, back.events):
        assert type(original) is type(decoded)
        if isinstance(original, BlockStored | BlockRemoved):
            assert [type(h) for h in original.block_hashes] == [type(h) for h in decoded.block_hashes]
    assert decode_batch(bytearray(data)) == batch and decode_batch(memoryview(data)) == batch  # type: ignore[arg-type]


def test_token_ids_default_keeps_positional_construction() -> None:
    event = BlockStored((b"a",), None, "device")
    assert event.token_ids is None and event == BlockStored((b"a",), None, "device", None)
    assert BlockStored((b"a",), None, "device", token_ids=(1,)) != event


def test_byte_hashes_travel_as_one_hex_string() -> None:
    hashes = tuple(bytes([k]) * 16 for k in range(64))
    data = encode_batch(EventBatch("w", 0, 0.0, (stored(*hashes, parent=H16[0]),)))
    assert data.count(b'"16:') == 1  # one packed string for the chain, not 64 strings
    assert len(data) < 2 * 16 * 65 + 120  # hex of the hashes and the parent plus a small header
    assert b'"version":1' in data and EVENT_FORMAT_VERSION == 1


def test_untagged_events_are_the_same_bytes_as_before_group_tags() -> None:
    """A single-group cache's events: exactly the bytes an old consumer reads (written out by hand here)."""
    batch = EventBatch(
        "w",
        2,
        0.5,
        (
            stored(b"\x01\x02", parent=None),
            stored(b"\x03\x04", parent=b"\x01\x02", tokens=(1, 2)),
            BlockRemoved((7,), "host"),
            AllBlocksCleared("device"),
        ),
    )
    assert encode_batch(batch) == (
        b'{"version":1,"producer":"w","seq":2,"ts":0.5,"snapshot":false,"events":['
        b'["S","device","2:0102",null],["S","device","2:0304","0102",[1,2]],["R","host",[7]],["C","device"]]}'
    )


def test_a_group_tag_travels_as_one_trailing_object() -> None:
    batch = EventBatch(
        "w",
        0,
        1.0,
        (
            stored(b"\x01\x02", parent=b"\x09", tokens=(3,), group=1, kind="sliding_window"),
            BlockRemoved((b"\x01\x02",), "device", 1, "sliding_window"),
            AllBlocksCleared("device", 0, "full"),
        ),
    )
    tag = b'{"group":1,"kind":"sliding_window"}'
    assert encode_batch(batch) == (
        b'{"version":1,"producer":"w","seq":0,"ts":1.0,"snapshot":false,"events":['
        b'["S","device","2:0102","09",[3],' + tag + b'],["R","device","2:0102",' + tag + b"],"
        b'["C","device",{"group":0,"kind":"full"}]]}'
    )
    assert decode_batch(encode_batch(batch)) == batch


def test_block_size_and_lora_travel_in_the_trailing_object_with_the_group() -> None:
    event = BlockStored((b"\x01\x02",), None, "host", (5, 6), 1, "full", block_size=2, lora_id=7, lora_name="a")
    data = encode_batch(EventBatch("w", 0, 1.0, (event, BlockRemoved((3,), "device", 2))))
    assert data.endswith(
        b'"events":[["S","host","2:0102",null,[5,6],{"group":1,"kind":"full","block_size":2,"lora_id":7,'
        b'"lora_name":"a"}],["R","device",[3],{"group":2}]]}'
    )
    assert decode_batch(data).events[0] == event


@pytest.mark.parametrize(
    "event",
    [
        BlockStored((1,), None, "device", (1, 2, 3), block_size=2),  # 3 tokens cannot be one block of 2
        BlockStored((1,), None, "device", block_size=0),
        BlockStored((1,), None, "device", lora_id=-1),
        BlockStored((1,), None, "device", lora_name=""),
        BlockRemoved((1,), "device", None, "full"),  # a kind needs a group
        BlockRemoved((1,), "device", -1),
    ],
)
def test_events_with_inconsistent_fields_have_no_encoding(event) -> None:
    with pytest.raises(InvalidArgumentError):
        encode_batch(EventBatch("w", 0, 1.0, (event,)))


def test_the_kinds_an_event_may_name_are_the_hybrid_layouts() -> None:
    from kvblocks.events import EVENT_GROUP_KINDS
    from kvblocks.hybrid.layout import GROUP_KINDS

    assert EVENT_GROUP_KINDS == GROUP_KINDS


def test_a_tag_with_none_leaves_the_event_equal_to_an_untagged_one() -> None:
    assert BlockRemoved((1,), "device") == BlockRemoved((1,), "device", None, None)
    assert BlockRemoved((1,), "device", 0, "full") != BlockRemoved((1,), "device")
    assert AllBlocksCleared("device", group=1, group_kind="sliding_window").group == 1


def _payload(**changes) -> bytes:
    import json

    raw = json.loads(encode_batch(EventBatch("w", 3, 1.5, (stored(*H16[:2]),))))
    for key, value in changes.items():
        if value is KeyError:
            del raw[key]
        else:
            raw[key] = value
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe",
        b"not json",
        b"[]",
        b"{}",
        b"[" * 100_000,
        _payload(version=2),
        _payload(version=True),
        _payload(version="1"),
        _payload(version=KeyError),
        _payload(producer=7),
        _payload(seq=-1),
        _payload(seq=1.0),
        _payload(seq=KeyError),
        _payload(ts="now"),
        _payload(ts=None),
        _payload(snapshot=1),
        _payload(events={}),
        _payload(events=[["X", "device"]]),
        _payload(events=[["S", "device", "16:00"]]),  # missing parent
        _payload(events=[["S", "device", "16:" + "00" * 15, None]]),  # not a multiple of the width
        _payload(events=[["S", "device", "0:", None]]),
        _payload(events=[["S", "device", "-2:0000", None]]),
        _payload(events=[["S", "device", "2:zzzz", None]]),
        _payload(events=[["S", "device", "2:00 0", None]]),  # whitespace fromhex would skip
        _payload(events=[["S", "device", ["0 1"], None]]),
        _payload(events=[["S", "device", [-1], None]]),
        _payload(events=[["S", "device", [True], None]]),
        _payload(events=[["S", "device", [1.5], None]]),
        _payload(events=[["S", "device", [""], None]]),
        _payload(events=[["S", "device", [1], None, [-3]]]),
        _payload(events=[["S", "device", [1], None, "tokens"]]),
        _payload(events=[["R", "device"]]),
        _payload(events=[["C", 5]]),
        _payload(events=[["C"]]),
        _payload(events=[[]]),
        _payload(events=["C"]),
        # group tags: an int in 0..2**63-1 and a known kind, both, nothing else, last
        _payload(events=[["C", "device", {"group": -1, "kind": "full"}]]),
        _payload(events=[["C", "device", {"group": 2**63, "kind": "full"}]]),
        _payload(events=[["C", "device", {"group": True, "kind": "full"}]]),
        _payload(events=[["C", "device", {"group": 1.0, "kind": "full"}]]),
        _payload(events=[["C", "device", {"group": "1", "kind": "full"}]]),
        _payload(events=[["C", "device", {"group": None, "kind": "full"}]]),
        _payload(events=[["C", "device", {"group": None, "kind": None}]]),
        _payload(events=[["C", "device", {"group": 1, "kind": "window"}]]),
        _payload(events=[["C", "device", {"group": 1, "kind": "Full"}]]),
        _payload(events=[["C", "device", {"group": 1, "kind": 0}]]),
        _payload(events=[["C", "device", {"group": 1, "kind": None}]]),  # a kind left out is absent, not null
        # metadata of a stored block: block size and LoRA only on "S", each in range, tokens matching
        _payload(events=[["R", "device", "2:0102", {"block_size": 16}]]),
        _payload(events=[["C", "device", {"lora_name": "a"}]]),
        _payload(events=[["S", "device", "2:0102", None, {"block_size": 0}]]),
        _payload(events=[["S", "device", "2:0102", None, {"block_size": True}]]),
        _payload(events=[["S", "device", "2:0102", None, {"lora_id": -1}]]),
        _payload(events=[["S", "device", "2:0102", None, {"lora_id": 2**63}]]),
        _payload(events=[["S", "device", "2:0102", None, {"lora_name": ""}]]),
        _payload(events=[["S", "device", "2:0102", None, {"lora_name": 3}]]),
        _payload(events=[["S", "device", "2:0102", None, [1, 2, 3], {"block_size": 2}]]),  # 3 tokens, 1 block of 2
        _payload(events=[["C", "device", {"kind": "full"}]]),
        _payload(events=[["C", "device", {}]]),
        _payload(events=[["C", "device", {"group": 1, "kind": "full", "x": 0}]]),
        _payload(events=[["C", "device", {"group": 1, "kind": "full"}, {"group": 1, "kind": "full"}]]),
        _payload(events=[["C", "device", [1, "full"]]]),
        _payload(events=[["R", "device", {"group": 1, "kind": "full"}]]),  # the tag where the hashes go
        _payload(events=[["R", "device", "2:0102", {"group": 1, "kind": "full"}, None]]),
        _payload(events=[["S", "device", "2:0102", {"group": 1, "kind": "full"}]]),  # the tag where the parent goes
        _payload(events=[["S", "device", "2:0102", None, {"group": 1, "kind": "full"}, [1]]]),  # tag before tokens
        _payload(events=[["S", "device", "2:0102", None, {"group": 1, "kind": "full"}, None]]),
    ],
)
def test_malformed_or_other_version_bytes_raise_event_decode_error(data) -> None:
    with pytest.raises(EventDecodeError) as info:
        decode_batch(data)
    assert isinstance(info.value, KVBlocksError) and isinstance(info.value, ValueError)


def _raw(**changes: str) -> bytes:
    """A valid batch with some fields' JSON text replaced verbatim (what json.dumps cannot write)."""
    import json

    raw = json.loads(encode_batch(EventBatch("w", 3, 1.5, (stored(*H16[:2]),))))
    for key in changes:
        raw[key] = f"@{key}@"
    text = json.dumps(raw)
    for key, value in changes.items():
        text = text.replace(f'"@{key}@"', value)
    return text.encode()


GOOD = encode_batch(EventBatch("w", 3, 1.5, (stored(*H16[:2]),)))


@pytest.mark.parametrize(
    "data",
    [
        _payload(events=[["S", "device", "9" * 5000 + ":00", None]]),  # int() of 5000 digits: a bare ValueError
        _payload(events=[["S", "device", "1" + "0" * 40 + ":00", None]]),  # an absurd width
        _raw(ts="1" + "0" * 400),  # math.isfinite(int) overflows
        _raw(ts="-" + "9" * 400),
        _raw(seq="9" * 5000),  # beyond the digit limit inside json itself
        _payload(seq=2**63),  # a forged seq would make every later batch a duplicate
        _payload(events=[["S", "device", "16:" + "00" * 16, None, [2**32]]]),  # token ids are u32
        _payload(producer="\ud800"),  # a lone surrogate: not text any encoder can write
        _payload(events=[["C", "\udfff"]]),
        GOOD.replace(b"{", b'{"seq":4,', 1),  # a repeated key: two readers could disagree
        GOOD.decode().encode("utf-16"),  # only UTF-8 is JSON between systems
        GOOD.decode().encode("utf-32"),
        b"\xef\xbb\xbf" + GOOD,  # a byte-order mark
        GOOD.replace(b"1.5", b"Infinity"),
        _payload(events=[["S", "device", [[[[[[[[[[1]]]]]]]]]], None]]),
        2**62,  # not bytes: bytes(2**62) is a MemoryError
        None,
    ],
    ids=[
        "width-5000-digits",
        "width-absurd",
        "ts-int-beyond-float",
        "ts-negative-int-beyond-float",
        "seq-5000-digits",
        "seq-2**63",
        "token-2**32",
        "producer-lone-surrogate",
        "tier-lone-surrogate",
        "repeated-key",
        "utf-16",
        "utf-32",
        "bom",
        "ts-infinity",
        "nested-hash",
        "int-not-bytes",
        "none-not-bytes",
    ],
)
def test_any_outside_bytes_raise_only_event_decode_error(data) -> None:
    with pytest.raises(EventDecodeError) as info:
        decode_batch(data)
    assert isinstance(info.value, KVBlocksError) and isinstance(info.value, ValueError)


def test_nan_timestamp_is_refused_both_ways() -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(_payload().replace(b'"ts": 1.5', b'"ts": NaN'))
    with pytest.raises(InvalidArgumentError):
        encode_batch(EventBatch("w", 0, math.inf, ()))


@pytest.mark.parametrize(
    "batch",
    [
        EventBatch("w", -1, 0.0, ()),
        EventBatch(5, 0, 0.0, ()),  # type: ignore[arg-type]
        EventBatch("w", 0, 0.0, (), snapshot=1),  # type: ignore[arg-type]
        EventBatch("w", 0, 0.0, (stored("text"),)),
        EventBatch("w", 0, 0.0, (stored(-5),)),
        EventBatch("w", 0, 0.0, (stored(b""),)),
        EventBatch("w", 0, 0.0, (stored(1, parent="p"),)),
        EventBatch("w", 0, 0.0, (stored(1, tokens=(1, -2)),)),
        EventBatch("w", 0, 0.0, ("not an event",)),  # type: ignore[arg-type]
        EventBatch("w", 0, 0.0, (BlockRemoved((1,), "device", None, "full"),)),  # a kind without its group
        EventBatch("w", 0, 0.0, (AllBlocksCleared("device", -1, "full"),)),
        EventBatch("w", 0, 0.0, (AllBlocksCleared("device", True, "full"),)),  # type: ignore[arg-type]
        EventBatch("w", 0, 0.0, (AllBlocksCleared("device", 2**63, "full"),)),
        EventBatch("w", 0, 0.0, (AllBlocksCleared("device", 1, "mamba"),)),
    ],
)
def test_batches_without_an_encoding_are_refused_with_a_value_error(batch) -> None:
    with pytest.raises(ValueError) as info:
        encode_batch(batch)
    assert isinstance(info.value, KVBlocksError)


def _package_imports() -> dict[str, set[str]]:
    """kvblocks module -> the kvblocks modules it imports anywhere in its source: at the top, in
    functions and under ``if TYPE_CHECKING:`` alike (a typing-only import is still a dependency)."""
    import ast
    import pathlib

    import kvblocks

    root = pathlib.Path(kvblocks.__file__).parent
    modules: dict[str, pathlib.Path] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, node.module] if node.module else base)
                targets.add(module)
                targets.update(f"{module}.{alias.name}" for alias in node.names)  # from pkg import module
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_transport_layer_never_imports_the_event_layer_above_it() -> None:
    graph = _package_imports()
    above = {"kvblocks.events", "kvblocks.events.sink", "kvblocks.events.publisher", "kvblocks.events.consumer"}
    for lower in ("kvblocks.events.transport", "kvblocks.events.codec"):
        assert not above & _reachable(graph, lower), f"{lower} imports the event layer above it"
    assert "kvblocks.events.transport" not in _reachable(graph, "kvblocks.events.codec")
    assert "kvblocks.events.publisher" not in _reachable(graph, "kvblocks.events.sink")


def test_no_kvblocks_module_imports_itself_through_others() -> None:
    """DESIGN.md: lower layers never import higher ones -- so the import graph has no cycle."""
    graph = _package_imports()
    cycles = sorted(name for name in graph if name != "kvblocks" and name in _reachable(graph, name))
    assert cycles == []


def test_import_kvblocks_and_the_event_modules_does_not_load_redis() -> None:
    code = (
        "import sys, kvblocks, kvblocks.events, kvblocks.events.transport, kvblocks.event_transport\n"
        "print('redis' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------- snapshot of a tree


@pytest.mark.parametrize("scheme", ["xxh3-128", "xxh3-64-1337"])
def test_snapshot_events_rebuild_the_tree_exactly_parents_first(scheme) -> None:
    rng = random.Random(5)
    for _ in range(20):
        work = Workload(EventSink(), scheme=scheme, num_blocks=12)
        work.run(rng, 60)
        tree = work.m.tree
        events = tree.snapshot_events()
        view: dict = {}
        apply_events(view, tuple(events))  # strict: a child before its parent would raise
        assert view == tree_view(tree)
        assert all(isinstance(e, BlockStored) and e.tier == "device" and e.block_hashes for e in events)
        # One event per chain: a chain starts at a root or below a node with several children.
        starts = [h for h, p in view.items() if p is None or sum(1 for q in view.values() if q == p) > 1]
        assert len(events) == len(starts)


def test_snapshot_of_an_empty_tree_is_empty_and_the_tier_is_the_trees() -> None:
    from kvblocks import BlockPool

    pool = BlockPool(3)
    tree = PrefixTree(pool, tier="host")
    assert tree.snapshot_events() == []
    tree.insert([b"a", b"b", b"c"], pool.take_fresh(3))
    assert tree.snapshot_events() == [BlockStored((b"a", b"b", b"c"), None, "host")]


# ---------------------------------------------------------------------- publisher and consumer


def wire(sink: EventSink, work: Workload | None = None, **kwargs) -> tuple[EventPublisher, InProcessTransport, Index]:
    transport = InProcessTransport()
    snapshot = None if work is None else work.m.tree.snapshot_events
    return EventPublisher("w0", sink, transport, snapshot=snapshot, **kwargs), transport, Index()


def test_in_order_batches_keep_the_view_equal_to_the_tree() -> None:
    sink = EventSink()
    work = Workload(sink)
    publisher, transport, index = wire(sink, work, max_batch=3)
    rng = random.Random(1)
    for step in range(200):
        work.step(rng.randrange(4), rng.randrange(100), rng.randrange(8))
        if step % 7 == 0:
            publisher.publish()
            pump(transport, index.consumer)
            assert index.of.get("w0", {}) == tree_view(work.m.tree)
    publisher.publish()
    pump(transport, index.consumer)
    assert index.of["w0"] == tree_view(work.m.tree) and len(index.of["w0"]) > 0
    assert index.consumer.gaps == 0 and not index.consumer.needs_resync
    assert index.consumer.last_seq("w0") == publisher.next_seq - 1 == index.consumer.batches - 1
    assert publisher.batches_sent == publisher.next_seq and publisher.events_sent == sink.next_seq


def test_batches_are_numbered_per_producer_and_split_by_max_batch() -> None:
    sink = EventSink()
    transport = InProcessTransport()
    publisher = EventPublisher("w0", sink, transport, max_batch=3)
    assert publisher.publish() == 0  # nothing to send: nothing sent, no number used
    ticks = iter(range(100))
    sink._clock = lambda: float(next(ticks))  # type: ignore[attr-defined]
    for k in range(10):
        sink.emit(BlockRemoved((k,), "device"))
    assert publisher.publish() == 4
    batches = [decode_batch(d) for d in transport.receive()]
    assert [b.seq for b in batches] == [0, 1, 2, 3]
    assert [len(b.events) for b in batches] == [3, 3, 3, 1]
    assert [b.timestamp for b in batches] == [2.0, 5.0, 8.0, 9.0]  # the newest event of each
    assert [e.block_hashes[0] for b in batches for e in b.events] == list(range(10))  # type: ignore[union-attr]
    assert {b.producer for b in batches} == {"w0"} and not any(b.snapshot for b in batches)


def test_a_dropped_batch_is_a_gap_and_the_view_is_frozen_until_a_snapshot() -> None:
    sink = EventSink()
    work = Workload(sink)
    publisher, transport, index = wire(sink, work)
    consumer = index.consumer
    rng = random.Random(2)
    sent = []
    for _ in range(6):
        while sink.next_seq == sum(len(decode_batch(d).events) for d in sent):
            work.run(rng, 1)  # until the tree changed
        publisher.publish()
        sent += transport.receive()
    for data in sent[:2] + sent[3:]:  # batch 2 is lost
        consumer.feed(decode_batch(data))
    assert index.gaps == [("w0", 2, 3)] and consumer.gaps == 1
    assert consumer.needs_resync == {"w0"} and consumer.last_seq("w0") == 1
    assert consumer.skipped == 2 and consumer.batches == 2  # batches 4 and 5 ignored, not applied
    frozen = dict(index.of["w0"])
    work.run(rng, 30)
    publisher.publish()
    pump(transport, index.consumer)
    assert index.of["w0"] == frozen and len(index.gaps) == 1  # still waiting, reported once
    publisher.publish_snapshot()
    pump(transport, index.consumer)
    assert consumer.needs_resync == set() and index.of["w0"] == tree_view(work.m.tree)
    assert consumer.last_seq("w0") == publisher.next_seq - 1
    work.run(rng, 30)  # and it follows again
    publisher.publish()
    pump(transport, index.consumer)
    assert index.of["w0"] == tree_view(work.m.tree) and consumer.gaps == 1


def test_sink_overflow_shows_as_a_gap_downstream() -> None:
    sink = EventSink(capacity=2)
    work = Workload(sink)
    publisher, transport, index = wire(sink, work)
    rng = random.Random(3)
    while sink.next_seq < 1:
        work.run(rng, 1)
    publisher.publish()
    pump(transport, index.consumer)
    assert index.consumer.last_seq("w0") == 0 and index.of["w0"] == tree_view(work.m.tree)
    before = sink.next_seq
    while sink.next_seq < before + 5:  # 5 records into a buffer of 2: 3 lost
        work.run(rng, 1)
    lost = sink.next_seq - before - 2
    assert publisher.publish() == 1
    assert publisher.records_lost == lost and publisher.next_seq == 3  # number 1 skipped
    pump(transport, index.consumer)
    assert index.gaps == [("w0", 1, 2)] and index.consumer.needs_resync == {"w0"}
    publisher.publish_snapshot()
    pump(transport, index.consumer)
    assert index.of["w0"] == tree_view(work.m.tree) and not index.consumer.needs_resync


def test_overflow_before_the_first_publish_is_a_gap_too() -> None:
    sink = EventSink(capacity=1)
    publisher = EventPublisher("w0", sink, InProcessTransport())
    sink.emit(AllBlocksCleared("device"))
    sink.emit(AllBlocksCleared("device"))
    publisher.publish()
    assert publisher.records_lost == 1 and publisher.next_seq == 2


def test_a_snapshot_discards_buffered_records_it_already_reflects() -> None:
    sink = EventSink()
    work = Workload(sink)
    publisher, transport, index = wire(sink, work)
    work.run(random.Random(4), 80)
    assert sink.next_seq > 0
    publisher.publish_snapshot()  # the records emitted so far are inside the snapshot
    assert publisher.publish() == 0
    pump(transport, index.consumer)
    assert index.of["w0"] == tree_view(work.m.tree) and index.consumer.gaps == 0
    work.run(random.Random(5), 40)
    publisher.publish()
    pump(transport, index.consumer)  # the strict index raises if anything was applied twice
    assert index.of["w0"] == tree_view(work.m.tree) and index.consumer.gaps == 0
    assert publisher.snapshots_sent == 1


def test_consumer_numbering_rules() -> None:
    index = Index()
    c = index.consumer
    ev = (stored(1),)
    assert c.last_seq("a") is None and c.last_event_time("a") is None
    assert c.feed(EventBatch("a", 0, 0.0, ev))  # a stream's start: accepted without a snapshot
    t0 = c.last_event_time("a")
    assert t0 is not None and abs(t0 - time.monotonic()) < 5
    assert not c.feed(EventBatch("a", 0, 0.0, (stored(9),), snapshot=False))  # a plain batch 0 again: restart
    assert index.gaps == [("a", 1, 0)] and c.restarts == 1 and c.needs_resync == {"a"}
    assert c.feed(EventBatch("a", 0, 0.0, (stored(2),), snapshot=True))  # restarted producer's snapshot
    assert index.of["a"] == {2: None} and c.restarts == 2 and not c.needs_resync
    assert c.feed(EventBatch("a", 1, 0.0, (stored(3, parent=2),)))
    assert not c.feed(EventBatch("a", 1, 0.0, (stored(3, parent=2),)))  # duplicate
    assert c.duplicates == 1 and index.of["a"] == {2: None, 3: 2}

    # A producer first seen mid-stream: the consumer has no base, so it asks for a snapshot.
    assert not c.feed(EventBatch("b", 5, 0.0, ev))
    assert index.gaps[-1] == ("b", 0, 5) and c.last_seq("b") is None and "b" not in index.of
    assert not c.feed(EventBatch("b", 6, 0.0, ev)) and c.skipped == 1
    assert c.feed(EventBatch("b", 9, 0.0, (stored(4),), snapshot=True))  # any later snapshot
    assert index.of["b"] == {4: None} and c.last_seq("b") == 9
    assert not c.feed(EventBatch("b", 8, 0.0, (), snapshot=True))  # an older snapshot is a duplicate
    assert c.feed(EventBatch("b", 12, 0.0, (), snapshot=True))  # a newer one replaces, no gap
    assert index.of["b"] == {} and c.gaps == 2 and c.producers == ["a", "b"]
    c.forget("b")
    assert c.last_seq("b") is None and c.producers == ["a"]
    assert c.feed(EventBatch("b", 0, 0.0, ()))


def test_a_failing_callback_propagates_and_marks_the_producer_for_resync() -> None:
    def broken(producer, events) -> None:
        raise RuntimeError("index bug")

    c = EventConsumer(on_events=broken, on_snapshot=lambda p, e: None)
    with pytest.raises(RuntimeError):
        c.feed(EventBatch("a", 0, 0.0, ()))
    assert c.needs_resync == {"a"}
    assert not c.feed(EventBatch("a", 1, 0.0, ()))
    assert c.feed(EventBatch("a", 2, 0.0, (), snapshot=True)) and not c.needs_resync


def test_pump_counts_and_skips_malformed_payloads(caplog) -> None:
    transport = InProcessTransport()
    index = Index()
    transport.send(encode_batch(EventBatch("a", 0, 0.0, (stored(1),))))
    transport.send(b"garbage")
    transport.send(encode_batch(EventBatch("a", 1, 0.0, (stored(2, parent=1),))))
    transport.send(_payload(version=99))
    transport.send(encode_batch(EventBatch("a", 3, 0.0, ())))  # batch 2 never came
    assert pump(transport, index.consumer, max_count=2) == 3
    assert index.consumer.malformed == 2 and "malformed" in caplog.text
    assert index.of["a"] == {1: None, 2: 1} and index.gaps == [("a", 2, 3)]
    assert pump(transport, index.consumer) == 0


def consumer_state(c: EventConsumer) -> dict:
    """Everything a payload could change in a consumer, through its public API."""
    return {
        "producers": {p: (c.last_seq(p), c.last_event_time(p)) for p in c.producers},
        "needs_resync": c.needs_resync,
        "counters": (c.batches, c.gaps, c.duplicates, c.skipped, c.restarts, c.feed_errors),
    }


def test_pump_survives_a_payload_that_raised_a_bare_value_error_and_feeds_the_rest(caplog) -> None:
    transport = InProcessTransport()
    index = Index()
    transport.send(encode_batch(EventBatch("a", 0, 0.0, (stored(1),))))
    transport.send(_payload(events=[["S", "device", "9" * 5000 + ":00", None]]))
    transport.send(encode_batch(EventBatch("a", 1, 0.0, (stored(2, parent=1),))))
    assert pump(transport, index.consumer) == 2
    assert index.consumer.malformed == 1 and index.of["a"] == {1: None, 2: 1} and not index.gaps


@pytest.mark.parametrize("error", [RecursionError, MemoryError, ValueError, TypeError, KeyError, OverflowError])
def test_pump_survives_any_exception_from_decoding_and_changes_nothing_but_the_count(monkeypatch, error) -> None:
    import kvblocks.events.transport as event_transport

    real = event_transport.decode_batch

    def decode(data: bytes) -> EventBatch:
        if data == b"poison":
            raise error("decoder bug")
        return real(data)

    monkeypatch.setattr(event_transport, "decode_batch", decode)
    transport = InProcessTransport()
    index = Index()
    transport.send(encode_batch(EventBatch("a", 0, 0.0, (stored(1),))))
    pump(transport, index.consumer)
    before = consumer_state(index.consumer)
    transport.send(b"poison")
    assert pump(transport, index.consumer) == 0
    assert consumer_state(index.consumer) == before and index.consumer.malformed == 1
    transport.send(b"poison")
    transport.send(encode_batch(EventBatch("a", 1, 0.0, (stored(2, parent=1),))))
    transport.send(b"poison")
    assert pump(transport, index.consumer, max_count=2) == 1  # the payload taken with the poison is fed
    assert index.consumer.malformed == 3 and index.of["a"] == {1: None, 2: 1}


def test_pump_survives_a_failing_callback_and_feeds_the_payloads_after_it(caplog) -> None:
    applied: list[tuple[str, int]] = []

    def on_events(producer: str, events) -> None:
        if producer == "bad":
            raise RuntimeError("index bug")
        applied.append((producer, len(events)))

    consumer = EventConsumer(on_events=on_events, on_snapshot=lambda p, e: None)
    transport = InProcessTransport()
    transport.send(encode_batch(EventBatch("bad", 0, 0.0, ())))
    transport.send(encode_batch(EventBatch("good", 0, 0.0, (stored(1),))))
    assert pump(transport, consumer) == 1
    assert applied == [("good", 1)] and consumer.needs_resync == {"bad"}
    assert consumer.feed_errors == 1 and consumer.malformed == 0 and "index bug" in caplog.text


def test_publisher_configuration_errors() -> None:
    sink = EventSink()
    t = InProcessTransport()
    assert isinstance(t, EventTransport)
    for bad in [{"producer": ""}, {"max_batch": 0}, {"max_batch": 1.5}, {"sink": []}]:
        args = {"producer": "w", "sink": sink, "max_batch": 1} | bad
        with pytest.raises(ConfigError):
            EventPublisher(args.pop("producer"), args.pop("sink"), t, **args)
    with pytest.raises(ConfigError):
        EventPublisher("w", sink, t).publish_snapshot()  # no snapshot callable


def test_a_transport_that_raises_leaves_a_gap() -> None:
    class Flaky(InProcessTransport):
        fail = False

        def send(self, data: bytes) -> None:
            if self.fail:
                raise OSError("link down")
            super().send(data)

    sink, transport = EventSink(), Flaky()
    publisher = EventPublisher("w0", sink, transport, max_batch=1)
    sink.emit(BlockRemoved((1,), "device"))
    sink.emit(BlockRemoved((2,), "device"))
    transport.fail = True
    with pytest.raises(OSError):
        publisher.publish()
    transport.fail = False
    sink.emit(AllBlocksCleared("device"))
    publisher.publish()
    assert [decode_batch(d).seq for d in transport.receive()] == [2]  # 0 and 1 never delivered


# ---------------------------------------------------------------------- in-process transport


def test_in_process_transport_is_bounded_ordered_and_closable() -> None:
    t = InProcessTransport(capacity=3)
    for k in range(5):
        t.send(bytes([k]))
    assert (t.sent, t.dropped, len(t)) == (5, 2, 3)
    assert t.receive(max_count=2) == [b"\x02", b"\x03"] and t.receive() == [b"\x04"] and t.receive() == []
    start = time.monotonic()
    assert t.receive(timeout_s=0.05) == [] and time.monotonic() - start >= 0.04
    timer = threading.Timer(0.05, t.send, args=(b"late",))
    timer.start()
    assert t.receive(timeout_s=5) == [b"late"]  # woken by the send, long before the timeout
    t.close()
    start = time.monotonic()
    assert t.receive(timeout_s=5) == [] and time.monotonic() - start < 1
    t.send(b"after close")
    assert t.dropped == 3 and t.receive() == []
    for bad in [{"max_count": 0}, {"max_count": 1.0}, {"timeout_s": -1}, {"timeout_s": math.nan}]:
        with pytest.raises(InvalidArgumentError):
            t.receive(**bad)
    with pytest.raises(ConfigError):
        InProcessTransport(capacity=0)


# ---------------------------------------------------------------------- property: random work, random loss


class Lossy(InProcessTransport):
    """Drops a send whenever ``drop`` says so; remembers whether the newest send got through."""

    def __init__(self, drop) -> None:
        super().__init__()
        self.drop = drop
        self.last_delivered = True
        self.lost = 0

    def send(self, data: bytes) -> None:
        self.last_delivered = not self.drop()
        if self.last_delivered:
            super().send(data)
        else:
            self.lost += 1


ops = st.lists(
    st.tuples(st.integers(0, 6), st.integers(0, 99), st.integers(0, 7)),
    min_size=15,
    max_size=60,
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    steps=ops,
    scheme=st.sampled_from(["xxh3-128", "xxh3-64-1337"]),
    capacity=st.sampled_from([4, 65536]),
    max_batch=st.sampled_from([1, 2, 256]),
)
def test_random_work_with_random_loss_never_leaves_a_wrong_view_unnoticed(
    data, steps, scheme, capacity, max_batch
) -> None:
    sink = EventSink(capacity=capacity)
    work = Workload(sink, scheme=scheme)
    transport = Lossy(lambda: data.draw(st.integers(0, 4), label="drop") == 0)  # about one send in five lost
    publisher = EventPublisher("w0", sink, transport, max_batch=max_batch, snapshot=work.m.tree.snapshot_events)
    index = Index()
    consumer = index.consumer
    published: dict = {}  # the tree as of the newest send
    checked = 0
    for op, pick, size in steps:
        if op <= 3:
            work.run(random.Random(pick * 4 + op), 1 + size)  # a burst of cache work
        elif op == 4:
            if publisher.publish():
                published = tree_view(work.m.tree)
        elif op == 5:
            pump(transport, consumer)
            # A consumer that believes it is in sync is right -- except after a loss with nothing
            # delivered behind it, which no receiver can notice yet.
            in_sync = "w0" not in consumer.needs_resync and consumer.last_seq("w0") is not None
            if in_sync and transport.last_delivered:
                assert index.of["w0"] == published
                checked += 1
        elif consumer.needs_resync:  # op 6: the router asks for a resync
            publisher.publish_snapshot()
            published = tree_view(work.m.tree)
        work.m.check_integrity()
    if (transport.lost or publisher.records_lost) and transport.last_delivered:
        pump(transport, consumer)
        assert consumer.gaps >= 1  # every loss with a delivery behind it was reported
    event(f"in-sync views checked: {min(checked, 3)}{'+' if checked >= 3 else ''}")
    event(f"gaps: {consumer.gaps > 0}")
    transport.drop = lambda: False
    publisher.publish_snapshot()  # records still in the sink are part of it
    pump(transport, consumer)
    assert not consumer.needs_resync
    assert index.of["w0"] == tree_view(work.m.tree)
    rng = random.Random(len(steps))
    for _ in range(10):  # and the view follows again (publishing often enough for a small sink buffer)
        work.run(rng, 1)
        publisher.publish()
    pump(transport, consumer)
    assert not consumer.needs_resync and index.of["w0"] == tree_view(work.m.tree)


def test_an_in_process_receive_waits_without_limit_for_an_infinite_timeout_and_refuses_a_bad_one() -> None:
    transport = InProcessTransport()
    threading.Timer(0.1, lambda: transport.send(b"late")).start()
    assert transport.receive(timeout_s=math.inf) == [b"late"]  # before: OverflowError
    transport.send(b"now")
    assert transport.receive(timeout_s=10**400) == [b"now"]  # an int past a float's range: no limit either
    for bad in (-1, math.nan, "1", True, None):
        with pytest.raises(InvalidArgumentError):
            transport.receive(timeout_s=bad)  # type: ignore[arg-type]
