"""KV events over real ZMQ sockets on 127.0.0.1: a kvblocks manager publishing in vLLM's wire to a router, a
fleet routed from the RECORDED vLLM / SGLang frames served by a tiny engine stand-in (gaps recovered through its
replay socket, or reset when the replay no longer reaches back), and the publisher's replay socket answering a
raw vLLM-style client frame for frame. A late joiner of an idle engine catches up from the replay socket at once;
a silent replay socket costs one receive one replay at most, then is backed off while the worker is reset."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvblocks import KVCacheManager
from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.events import BlockRemoved, BlockStored, EventBatch, EventConsumer, EventPublisher, EventSink
from kvblocks.hashing import block_hashes, vllm_int_hash
from kvblocks.interop.engine_wire import encode_engine_batch
from kvblocks.interop.zmq_events import END_SEQ, ZmqEventPublisher, ZmqEventSubscriber, pump_subscriber
from kvblocks.routing import Router, RouterConfig
from tests.support.recorded_engine import ANY_PORT, RecordedEngine, _connected, _load, _until


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


# ---------------------------------------------------------------- a late join, a silent replay socket


class StandInEngine(RecordedEngine):
    """An engine publishing batch k = (remove block k-2, store block k): after batch k it holds blocks k-1 and
    k, so a view that applied a batch over a gap keeps a block the engine no longer holds. Its replay socket
    answers as vLLM's does (it buffers every batch), or is ``silent``."""

    def __init__(self) -> None:
        super().__init__({"live": [], "buffer_steps": 1_000_000}, "kv")

    def publish(self, live: bool = True) -> int:
        k = len(self.frames)
        gone = (BlockRemoved((k - 1,), "device"),) if k >= 2 else ()
        batch = EventBatch("w", k, 1.0, (*gone, BlockStored((k + 1,), None, "device", None, block_size=4)))
        self.frames.append([b"kv", k.to_bytes(8, "big"), encode_engine_batch(batch)])
        self.advance(live)
        return k

    @staticmethod
    def holds(k: int) -> set[int]:
        """The block hashes the engine holds after batch ``k``."""
        return {h + 1 for h in (k - 1, k) if h >= 0}

    def connect(self, sub: ZmqEventSubscriber) -> None:
        """Publish batch 0 live, re-sent until the SUB has it (ZMQ's slow joiner); repeats are duplicates."""
        if not self.frames:
            self.publish()
        _connected(sub, self)


class ViewOf:
    """A router's view of worker "w" (the block hashes it believes the worker holds), fed by an EventConsumer."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.batches: list[EventBatch] = []
        self.consumer = EventConsumer(on_events=self._apply, on_snapshot=self._replace)

    def _apply(self, producer: str, events: tuple[Any, ...]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self.blocks.update(e.block_hashes)
            else:
                self.blocks.difference_update(e.block_hashes)

    def _replace(self, producer: str, events: tuple[Any, ...]) -> None:
        self.blocks = set()
        self._apply(producer, events)

    def pump(self, sub: ZmqEventSubscriber, timeout_s: float = 0.01) -> float:
        """One pump_subscriber; return how long it took."""
        start = time.monotonic()
        pump_subscriber(sub, self.consumer, timeout_s=timeout_s, on_batch=self.batches.append)
        return time.monotonic() - start


@pytest.fixture
def engines() -> Iterator[Callable[..., tuple[StandInEngine, ZmqEventSubscriber]]]:
    made: list[Any] = []

    def make(**options: Any) -> tuple[StandInEngine, ZmqEventSubscriber]:
        engine = StandInEngine()
        made.append(engine)
        sub = ZmqEventSubscriber(engine.endpoint, engine.replay_endpoint, worker="w", topic="kv", **options)
        made.append(sub)
        return engine, sub

    yield make
    for thing in made:
        thing.close()


def test_one_receive_waits_for_one_silent_replay_at_most_and_resets_the_worker(engines: Any) -> None:
    """30 gaps and a replay socket that never answers: the old subscriber waited replay_timeout_s for each
    (30 x 0.2 s = 6 s in one pump); now the first gap waits once, the socket is backed off, and every gap
    resets the worker at once."""
    engine, sub = engines(replay_timeout_s=0.2, replay_backoff_s=30.0)
    view = ViewOf()
    engine.connect(sub)
    view.pump(sub)
    assert view.consumer.last_seq("w") == 0 and sub.replays == 0
    engine.silent = True
    for _ in range(30):
        engine.publish(live=False)
        last = engine.publish()
    took: list[float] = []
    _until(lambda: view.consumer.last_seq("w") == last, lambda: took.append(view.pump(sub)))
    assert sum(took) < 0.2 + 1.0, took  # one replay (0.2 s) and the pumps' own waits, with room for a slow machine
    assert (sub.gaps, sub.replays, sub.replay_failures, sub.resets) == (30, 1, 1, 30)
    _until(lambda: len(engine.requests) == 1, lambda: time.sleep(0.005))  # the one request reached the engine
    assert [b.snapshot for b in view.batches] == [False] + [True] * 30
    assert not view.consumer.needs_resync and view.blocks <= engine.holds(last) and last + 1 in view.blocks


def test_a_silent_replay_socket_is_backed_off_exponentially_up_to_a_bound_while_other_workers_flow(
    engines: Any,
) -> None:
    """A router loop pumping two workers: one loses every other batch and its replay socket is silent; it is
    asked again only after 0.05, 0.1, 0.2, 0.2, ... s (plus the 0.05 s it waits each time), every gap resets
    it, and the other worker's batches arrive in the same loop all along."""
    timeout, first, cap = 0.05, 0.05, 0.2
    engine, sub = engines(replay_timeout_s=timeout, replay_backoff_s=first, replay_backoff_max_s=cap)
    healthy, other = engines()
    view, other_view = ViewOf(), ViewOf()
    engine.connect(sub)
    healthy.connect(other)
    view.pump(sub)
    other_view.pump(other)
    engine.silent = True
    attempts: list[float] = []  # when each pump that sent a replay request began
    slowest, most_replays_in_a_turn = 0.0, 0
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        engine.publish(live=False)
        engine.publish()
        healthy.publish()
        replays, began = sub.replays, time.monotonic()
        slowest = max(slowest, view.pump(sub) + other_view.pump(other))
        most_replays_in_a_turn = max(most_replays_in_a_turn, sub.replays - replays)
        if sub.replays > replays:
            attempts.append(began)
        time.sleep(0.005)
    # a loop turn never waits for more than one replay: counted, and timed with the slack of a busy machine (a
    # full suite's run has paused one turn for 0.8 s)
    assert most_replays_in_a_turn == 1
    assert slowest < timeout + 1.2
    # each pause is at least the back-off (a pump may begin up to its 10 ms live wait before the retry is due)
    pauses = [b - a for a, b in itertools.pairwise(attempts)]
    waits = [timeout + min(first * 2**i, cap) for i in range(len(pauses))]
    assert all(p >= w - 0.02 for p, w in zip(pauses, waits, strict=True)), (pauses, waits)
    # ... and bounded: in 2 s, 0, .1, .2, .35, .6, .85, 1.1, ... (7 or more) where a doubling without a cap has 5
    assert len(attempts) >= 6, pauses
    assert sub.replays == sub.replay_failures == len(attempts)
    assert sub.resets == sub.gaps and not view.consumer.needs_resync
    assert view.blocks <= engine.holds(len(engine.frames) - 1)
    # the healthy worker kept flowing: it is one pump from caught up, gaps and replays none
    _until(lambda: other_view.consumer.last_seq("w") == len(healthy.frames) - 1, lambda: other_view.pump(other))
    assert (other.gaps, other.replays, other.resets) == (0, 0, 0)
    assert other_view.blocks == healthy.holds(len(healthy.frames) - 1)


def test_a_second_gap_waits_for_the_next_receive_and_its_own_replay(engines: Any) -> None:
    """An engine that loses a batch again while it answers each replay: the old subscriber replayed again and
    again in one receive (5 times here); now each receive replays once, and the gap it leaves is recovered by
    the next receive's replay, not reset."""
    engine, sub = engines(replay_timeout_s=2.0)
    view = ViewOf()
    engine.connect(sub)
    view.pump(sub)
    more = [5]

    def lose_one_more() -> None:  # a new batch lost, and a later one live, before the answer goes out
        if more[0]:
            more[0] -= 1
            engine.publish(live=False)
            engine.publish()
            time.sleep(0.05)

    engine.on_request = lose_one_more
    engine.publish(live=False)
    engine.publish()
    _until(lambda: sub._sub.poll(0) != 0, lambda: time.sleep(0.005))
    view.pump(sub)
    assert sub.replays == 1
    _until(lambda: view.consumer.last_seq("w") == 12, lambda: view.pump(sub))
    assert (sub.replays, sub.resets) == (6, 0) and sub.gaps == 6
    assert [b.seq for b in view.batches] == list(range(13))
    assert view.blocks == engine.holds(12)


def test_replays_asked_of_an_engine_not_there_yet_do_not_pile_up(engines: Any) -> None:
    """Every retry of a replay socket nobody has bound waited in ZMQ's queue, and the engine would answer
    each with its whole buffer when it came; now one request waits, and a retry that cannot be sent counts
    as one more silence."""
    engine, _ = engines()
    probe = zmq.Context.instance().socket(zmq.ROUTER)
    probe.bind(ANY_PORT)
    replay = probe.getsockopt_string(zmq.LAST_ENDPOINT)
    probe.close(linger=0)  # a free port: the engine's replay socket, not bound yet
    sub = ZmqEventSubscriber(
        engine.endpoint,
        replay,
        worker="w",
        topic="kv",
        replay_timeout_s=0.01,
        replay_backoff_s=0.001,
        replay_backoff_max_s=0.001,
    )
    router = zmq.Context.instance().socket(zmq.ROUTER)
    try:
        view = ViewOf()
        engine.connect(sub)
        for _ in range(20):
            engine.publish(live=False)
            engine.publish()
            time.sleep(0.003)
            view.pump(sub)
        assert sub.replays == sub.replay_failures >= 10 and sub.resets == sub.gaps
        router.bind(replay)  # the engine comes
        requests = []
        while router.poll(500):
            requests.append(router.recv_multipart())
        assert len(requests) == 1
    finally:
        router.close(linger=0)
        sub.close()


def test_receive_accepts_an_infinite_timeout_and_refuses_one_that_is_not_a_number(engines: Any) -> None:
    engine, sub = engines()
    got: list[EventBatch] = []
    waiting = threading.Thread(target=lambda: got.extend(sub.receive(math.inf)), daemon=True)
    waiting.start()
    time.sleep(0.2)
    assert not got  # still waiting: nothing was published
    engine.publish()
    _until(lambda: not waiting.is_alive(), lambda: (engine.pub.send_multipart(engine.frames[0]), time.sleep(0.01)))
    assert [b.seq for b in got] == [0]
    engine.publish()
    more: list[EventBatch] = []  # past a float's range: no limit either (the first receives may take repeats of 0)
    _until(lambda: bool(more), lambda: more.extend(sub.receive(10**400)))
    assert [b.seq for b in more] == [1]
    for bad in (-1, math.nan, "1", True, None):
        with pytest.raises(InvalidArgumentError):
            sub.receive(bad)  # type: ignore[arg-type]
    for name, value in (("replay_timeout_s", math.inf), ("replay_backoff_s", 0), ("replay_backoff_max_s", 10**400)):
        with pytest.raises(ConfigError):
            ZmqEventSubscriber(engine.endpoint, worker="w", **{name: value})
    with pytest.raises(ConfigError):
        ZmqEventSubscriber(engine.endpoint, worker="w", replay_backoff_s=2.0, replay_backoff_max_s=1.0)


def test_a_late_joiner_of_an_idle_vllm_engine_catches_up_from_its_replay_socket(fleet: Any) -> None:
    """The recorded vLLM streams published before the router existed, and nothing since: the router learns
    them at once from the replay socket (from seq 0) instead of waiting for a batch that may never come.
    vllm-1 keeps only 3 batches: its view starts at the earliest it still has, as a snapshot."""
    data = _load("vllm")
    r = Router(["vllm-0", "vllm-1"], RouterConfig(block_size=4))
    consumer = EventConsumer(on_events=r.apply_events, on_snapshot=r.replace_index)
    joined = []
    for worker in data["workers"][:2]:
        server, sub = fleet("vllm", worker)
        for _ in server.frames:
            server.advance(live=False)
        joined.append((server, sub))
    for server, sub in joined:
        _until(
            lambda s=sub, e=server: consumer.last_seq(s.worker) == len(e.frames) - 1,
            lambda s=sub: pump_subscriber(s, consumer, timeout_s=0.05),
        )
        assert server.requests == [0] and sub.gaps == 0
    (_, vllm0), (server1, vllm1) = joined
    assert vllm0.resets == 0 and vllm1.resets == 1 and vllm1.replayed == server1.buffer.maxlen == 3
    assert not consumer.needs_resync
    prompts = data["prompts"]
    for name, expected in (("vllm-0", {"A": 2.0, "B": 3.5, "D": 0.25}), ("vllm-1", {"A": 2.0, "B": 2.0, "D": 0.0})):
        assert {p: r.overlaps(_vllm_hashes(prompts[p], True)).get(name, 0.0) for p in "ABD"} == expected, name


def test_a_late_joiner_of_an_engine_that_never_published_waits_for_batch_0_live(fleet: Any) -> None:
    """The join's replay finds nothing (the end marker alone): the subscriber asks once, not at every receive,
    and takes batch 0 live as the stream's start, not as a reset."""
    data = _load("vllm")
    server, sub = fleet("vllm", data["workers"][0])
    seen: list[EventBatch] = []
    consumer = EventConsumer(on_events=lambda *a: None, on_snapshot=lambda *a: None)
    for _ in range(5):
        assert pump_subscriber(sub, consumer, timeout_s=0.02, on_batch=seen.append) == 0
    assert server.requests == [0] and sub.replays == 1 and sub.replay_failures == 0
    _connected(sub, server)
    server.advance(live=False)
    _until(lambda: bool(seen), lambda: pump_subscriber(sub, consumer, timeout_s=0.05, on_batch=seen.append))
    assert [(b.seq, b.snapshot) for b in seen] == [(0, False)] and sub.resets == 0
    assert server.requests == [0] and consumer.last_seq("vllm-0") == 0


class SubscriberMachine(RuleBasedStateMachine):
    """An engine publishing (batches lost or live), its replay socket answering or silent, a router pumping:
    no pump waits more than one replay, the router's view never holds a block the engine dropped, the
    consumer never waits for a resync, and once the replay socket answers again the router catches up."""

    def __init__(self) -> None:
        super().__init__()
        self.engine = StandInEngine()
        self.sub = ZmqEventSubscriber(
            self.engine.endpoint,
            self.engine.replay_endpoint,
            worker="w",
            topic="kv",
            replay_timeout_s=0.05,
            replay_backoff_s=0.02,
            replay_backoff_max_s=0.1,
        )
        self.view = ViewOf()
        self.engine.connect(self.sub)

    @rule(live=st.booleans())
    def publish(self, live: bool) -> None:
        self.engine.publish(live)

    @rule(silent=st.booleans())
    def replay_socket(self, silent: bool) -> None:
        self.engine.silent = silent

    @rule()
    def pump(self) -> None:
        assert self.view.pump(self.sub) < 0.01 + 0.05 + 0.5

    @invariant()
    def the_view_promises_no_more_than_the_engine_holds(self) -> None:
        last = self.view.consumer.last_seq("w")
        assert not self.view.consumer.needs_resync
        assert self.view.blocks <= (set() if last is None else self.engine.holds(last))
        seqs = [b.seq for b in self.view.batches]
        assert seqs == sorted(set(seqs))

    def teardown(self) -> None:
        try:
            self.engine.silent = False
            time.sleep(0.1)  # the longest back-off
            last = self.engine.publish()
            _until(lambda: self.view.consumer.last_seq("w") == last, self.pump)
            assert last + 1 in self.view.blocks and self.view.blocks <= self.engine.holds(last)
        finally:
            self.sub.close()
            self.engine.close()


SubscriberMachine.TestCase.settings = settings(max_examples=8, stateful_step_count=20, deadline=None)
test_a_subscriber_keeps_a_true_view_through_losses_and_silences = SubscriberMachine.TestCase
