"""KV events over real ZMQ sockets on 127.0.0.1: a kvblocks manager publishing in vLLM's wire to a router, a
fleet routed from the RECORDED vLLM / SGLang frames served by a tiny engine stand-in (gaps recovered through its
replay socket, or reset when the replay no longer reaches back), and the publisher's replay socket answering a
raw vLLM-style client frame for frame."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from kvblocks import KVCacheManager
from kvblocks.errors import ConfigError
from kvblocks.events import BlockStored, EventBatch, EventConsumer, EventPublisher, EventSink
from kvblocks.hashing import block_hashes, vllm_int_hash
from kvblocks.interop.zmq_events import END_SEQ, ZmqEventPublisher, ZmqEventSubscriber, pump_subscriber
from kvblocks.routing import Router, RouterConfig
from tests.recorded_engine import ANY_PORT, RecordedEngine, _connected, _load, _until


@pytest.fixture
def fleet() -> Iterator[Callable[[str, dict[str, Any]], tuple[RecordedEngine, ZmqEventSubscriber]]]:
    made: list[Any] = []

    def make(engine: str, worker: dict[str, Any]) -> tuple[RecordedEngine, ZmqEventSubscriber]:
        data = _load(engine)
        server = RecordedEngine(worker, data["topic"])
        sub = ZmqEventSubscriber(
            server.endpoint,
            server.replay_endpoint,
            worker=worker["name"],
            topic=data["topic"],
            dialect=engine,  # type: ignore[arg-type]
        )
        made.extend([server, sub])
        return server, sub

    yield make
    for thing in made:
        thing.close()


def _vllm_hashes(tokens: list[int], int_form: bool) -> list[Any]:
    """The hashes vLLM gives a prompt (recomputed by kvblocks, as llm-d does), in the form its events carry."""
    h = block_hashes(tokens, 4, scheme="vllm-sha256")
    return [vllm_int_hash(x) for x in h] if int_form else list(h)


def test_a_router_routes_a_fleet_from_recorded_vllm_streams_with_a_gap_recovered_by_replay(fleet: Any) -> None:
    data = _load("vllm")
    r = Router([w["name"] for w in data["workers"]], RouterConfig(block_size=4))
    consumer = EventConsumer(on_events=r.apply_events, on_snapshot=r.replace_index)
    subs = []
    for worker in data["workers"]:
        server, sub = fleet("vllm", worker)
        _connected(sub, server)
        server.advance(live=False)  # frame 0 came already (the join probe)
        for k in range(1, len(server.frames)):
            server.advance(live=k not in (1, 2))  # frames 1 and 2 are lost on the way
        # vllm-1's engine keeps 3 batches: by the time its subscriber asks, 1 and 2 are gone (a reset instead)
        subs.append((sub, len(server.frames) - 1, int(worker["buffer_steps"] < len(server.frames) - 2)))
    for sub, last, resets in subs:
        _until(
            lambda s=sub, n=last: consumer.last_seq(s.worker) == n,
            lambda s=sub: pump_subscriber(s, consumer, timeout_s=0.05),
        )
        assert (sub.gaps, sub.resets, sub.replays) == (1, resets, 1) and sub.replayed >= 2, sub.worker
    assert not consumer.needs_resync
    # What each worker holds after its script (device 1, host 0.5, storage 0.25 per block, leading run):
    # vllm-0/-2: A lost its block 2 from the GPU; B's block 3 moved to the CPU; D's block 0 is in storage;
    # vllm-1 cleared everything and stored A's first two blocks again.
    prompts = data["prompts"]
    for name, int_form in (("vllm-0", True), ("vllm-1", True), ("vllm-2", False)):
        overlap = {p: r.overlaps(_vllm_hashes(prompts[p], int_form)).get(name, 0.0) for p in "ABD"}
        expected = {"A": 2.0, "B": 2.0, "D": 0.0} if name == "vllm-1" else {"A": 2.0, "B": 3.5, "D": 0.25}
        assert overlap == expected, name
    with r.route(block_hashes=_vllm_hashes(prompts["B"], True), num_tokens=len(prompts["B"])) as lease:
        assert lease.worker == "vllm-0"
    r.check_integrity()


def test_a_replay_that_cannot_fill_the_gap_resets_the_worker(fleet: Any) -> None:
    """vllm-1's engine keeps 3 batches: a subscriber that missed 1..4 recovers only 3 and 4, so it starts
    the worker's view again at 3 (a snapshot) rather than apply 3 on top of a view that lacks 1 and 2."""
    data = _load("vllm")
    worker = data["workers"][1]
    assert worker["buffer_steps"] == 3
    server, sub = fleet("vllm", worker)
    r = Router(["vllm-1"], RouterConfig(block_size=4))
    seen: list[EventBatch] = []
    consumer = EventConsumer(on_events=r.apply_events, on_snapshot=r.replace_index)
    _connected(sub, server)  # the subscriber takes frame 0 live
    server.advance(live=False)
    pump_subscriber(sub, consumer, timeout_s=1.0, on_batch=seen.append)
    for k in range(1, 6):
        server.advance(live=k == 5)
    _until(
        lambda: consumer.last_seq("vllm-1") == 5,
        lambda: pump_subscriber(sub, consumer, timeout_s=0.05, on_batch=seen.append),
    )
    assert (sub.gaps, sub.resets) == (1, 1)
    assert [(b.seq, b.snapshot) for b in seen[1:]] == [(3, True), (4, False), (5, False)]
    assert not consumer.needs_resync
    prompts = data["prompts"]
    # The view restarted at 3: A's blocks (stored by batch 0) are unknown, C's (batch 3) known.
    assert r.overlaps(_vllm_hashes(prompts["A"], True)).get("vllm-1", 0.0) == 0.0
    assert r.overlaps(_vllm_hashes(prompts["C"], True)).get("vllm-1", 0.0) == 0.0  # C is hashed with its LoRA
    c_hashes = [h for h in worker["script"][3][0]["block_hashes"]]
    assert r.overlaps(c_hashes)["vllm-1"] == 2.0
    server.advance()  # AllBlocksCleared
    server.advance()  # A's first two blocks again
    _until(lambda: consumer.last_seq("vllm-1") == 7, lambda: pump_subscriber(sub, consumer, timeout_s=0.05))
    assert r.overlaps(_vllm_hashes(prompts["A"], True))["vllm-1"] == 2.0
    assert r.overlaps(c_hashes).get("vllm-1", 0.0) == 0.0


def test_a_late_joining_sglang_subscriber_recovers_the_whole_stream(fleet: Any) -> None:
    data = _load("sglang")
    worker = data["workers"][0]
    server, sub = fleet("sglang", worker)
    for _ in range(len(server.frames) - 1):
        server.advance(live=False)  # published before the subscriber existed
    _connected(sub, server)  # the join probe re-sends frame 0 (the SUB's first message; repeats are duplicates)
    r = Router(["sglang-0"], RouterConfig(block_size=4))
    consumer = EventConsumer(on_events=r.apply_events, on_snapshot=r.replace_index)
    server.advance()
    n = len(worker["live"]) - 1
    _until(lambda: consumer.last_seq("sglang-0") == n, lambda: pump_subscriber(sub, consumer, timeout_s=0.05))
    assert sub.resets == 0 and sub.replayed >= n
    signed = [h for b in worker["script"] for e in b for h in e.get("block_hashes", [])]
    held = r.load("sglang-0").cached_blocks
    assert held > 0 and any(h < 0 for h in signed)
    # SGLang's signed int64 hashes are indexed in their unsigned form: A's two first blocks stay on the GPU.
    a_hashes = [h & (2**64 - 1) for h in worker["script"][0][0]["block_hashes"]]
    assert r.overlaps(a_hashes)["sglang-0"] == 2.0


def test_a_kvblocks_manager_reaches_a_router_through_vllm_zmq_wire() -> None:
    sink = EventSink()
    m = KVCacheManager(num_blocks=32, block_size=4, event_sink=sink)
    with ZmqEventPublisher(ANY_PORT, ANY_PORT, topic="kv@w0") as transport:
        publisher = EventPublisher("w0", sink, transport, snapshot=m.snapshot_events)
        sub = ZmqEventSubscriber(transport.endpoint, transport.replay_endpoint, worker="w0", topic="kv@w0")
        r = Router(["w0", "w1"], RouterConfig(block_size=4))
        consumer = EventConsumer(on_events=r.apply_events, on_snapshot=r.replace_index)
        prompts = {"a": list(range(100, 117)), "b": list(range(100, 108)) + list(range(300, 309))}
        for seq_id, toks in prompts.items():
            m.add_sequence(seq_id, toks)
            m.allocate(seq_id, len(toks))
            m.commit(seq_id, len(toks))
            publisher.publish()
        try:
            _until(
                lambda: consumer.last_seq("w0") == publisher.next_seq - 1,
                lambda: pump_subscriber(sub, consumer, timeout_s=0.05),
            )
        finally:
            sub.close()
        assert transport.flush()  # ``sent`` is counted just after a batch left: the subscriber may be first
        assert transport.sent == publisher.batches_sent and transport.dropped == transport.errors == 0
    for toks in prompts.values():
        wire = [vllm_int_hash(h) for h in block_hashes(toks, 4)]
        assert r.overlaps(wire)["w0"] == 4.0  # 17 tokens: 4 full blocks cached
    stored = {h for e in m.snapshot_events() for h in e.block_hashes}
    assert r.load("w0").cached_blocks == len(stored) == 6
    assert not consumer.needs_resync


def test_the_publishers_replay_answers_a_raw_vllm_client_frame_for_frame() -> None:
    ctx = zmq.Context.instance()
    with ZmqEventPublisher(ANY_PORT, ANY_PORT, topic="kv", buffer_steps=3, dp_rank=1) as pub:
        batches = [
            EventBatch("w", k, 10.0 + k, (BlockStored((k + 1,), None, "device", None, 0, "full", 4),)) for k in range(5)
        ]
        for b in batches:
            pub.send_batch(b)
        assert pub.flush()
        client = ctx.socket(zmq.DEALER)
        client.connect(pub.replay_endpoint)
        try:
            client.send_multipart([b"", b"bogus", b"request"])  # ignored and counted, as vLLM does
            client.send_multipart([b"", (0).to_bytes(8, "big")])
            frames = []
            while not frames or frames[-1][2] != END_SEQ:
                assert client.poll(5000)
                frames.append(client.recv_multipart())
        finally:
            client.close(linger=0)
        _until(lambda: pub.replays == 1, lambda: time.sleep(0.001))  # counted just after the end marker left
        assert pub.errors == 1 and pub.replays == 1
    assert frames[-1] == [b"", b"", END_SEQ, b""]
    assert [f[:3] for f in frames[:-1]] == [[b"", b"kv", k.to_bytes(8, "big")] for k in (2, 3, 4)]
    for f, k in zip(frames[:-1], (2, 3, 4), strict=True):
        ts, events, rank = msgspec.msgpack.decode(f[3])  # what a vLLM consumer decodes
        assert (ts, rank) == (10.0 + k, 1)
        assert events == [
            {
                "type": "BlockStored",
                "block_hashes": [k + 1],
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        ]


def test_a_malformed_payload_is_counted_and_the_next_batch_resets(fleet: Any) -> None:
    data = _load("vllm")
    worker = dict(data["workers"][0])
    server, sub = fleet("vllm", worker)
    server.frames[1] = [server.frames[1][0], server.frames[1][1], b"\x93\xc1"]
    _connected(sub, server)
    seen: list[EventBatch] = []
    consumer = EventConsumer(on_events=lambda *a: None, on_snapshot=lambda *a: None)
    server.advance(live=False)
    server.advance()
    server.advance()
    _until(lambda: sub.last_seq == 2, lambda: pump_subscriber(sub, consumer, timeout_s=0.05, on_batch=seen.append))
    assert sub.malformed == 1 and [(b.seq, b.snapshot) for b in seen] == [(0, False), (2, True)]
    assert not consumer.needs_resync


def test_a_binding_subscriber_reads_an_engine_whose_pub_socket_connects() -> None:
    """vLLM's PUB socket connects when its endpoint has no '*': the consumer binds, and reads batches 0, 1."""
    from kvblocks.interop.engine_wire import encode_engine_batch

    sub = ZmqEventSubscriber("tcp://127.0.0.1:*", worker="w0", topic="kv", bind=True)
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        assert sub.endpoint.startswith("tcp://127.0.0.1:") and not sub.endpoint.endswith("*")
        pub.connect(sub.endpoint)
        hashes = _vllm_hashes(list(range(8)), int_form=False)
        batches = [
            EventBatch("w0", 0, 1.0, (BlockStored((hashes[0],), None, "device", None, block_size=4),)),
            EventBatch("w0", 1, 2.0, (BlockStored((hashes[1],), hashes[0], "device", None, block_size=4),)),
        ]
        frames = [(b"kv", b.seq.to_bytes(8, "big"), encode_engine_batch(b, int_hashes=False)) for b in batches]
        got: list[EventBatch] = []
        # A PUB socket that connects drops what it sends before it has taken in the subscription (vLLM's first
        # batches are lost so; its replay socket recovers them): send batch 0 until it arrives (a repeat is
        # dropped by the subscriber as a duplicate), then batch 1.
        _until(lambda: bool(got), lambda: (pub.send_multipart(frames[0]), got.extend(sub.receive(0.05, 10))))
        pub.send_multipart(frames[1])
        _until(lambda: len(got) == 2, lambda: got.extend(sub.receive(0.05, 10)))
        assert [b.seq for b in got] == [0, 1]
        assert [e.block_hashes for b in got for e in b.events] == [(hashes[0],), (hashes[1],)]
        assert sub.gaps == 0
    finally:
        pub.close()
        sub.close()
    with pytest.raises(ConfigError):
        ZmqEventSubscriber("tcp://127.0.0.1:*", worker="w0", bind="yes")  # type: ignore[arg-type]
