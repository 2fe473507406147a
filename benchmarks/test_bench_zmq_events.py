"""KV events published and consumed over ZMQ on loopback in vLLM's wire, against the in-process transport.

One round: 12,800 ``BlockStored`` events (one 64-bit hash and 16 token ids each, as vLLM's events carry)
go into a sink, an :class:`EventPublisher` sends them as 50 batches of 256, and the consumer side applies
them to a :class:`Router` -- through :class:`InProcessTransport` and :func:`pump` (kvblocks' JSON), or through
:class:`ZmqEventPublisher` -> PUB/SUB on 127.0.0.1 -> :class:`ZmqEventSubscriber` -> :func:`pump_subscriber`
(vLLM's msgpack; the publisher's thread encodes and sends). ``extra_info["events_per_s"]`` is the figure.

The stall bound: one :func:`pump_subscriber` (``timeout_s=0.01``) that meets 30 or 1,000 gaps while the
engine's replay socket takes requests and never answers (``replay_timeout_s=0.2``). It waits for one replay
at most (a subscriber that waited for every gap took 30 x 0.2 = 6 s, or 200 s); ``extra_info["pump_s"]``.

    python -m pytest benchmarks/test_bench_zmq_events.py --benchmark-enable -q
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvblocks.events import BlockStored, EventBatch, EventConsumer, EventPublisher, EventSink
from kvblocks.events.transport import InProcessTransport, pump
from kvblocks.routing import Router, RouterConfig

zmq_events = pytest.importorskip("kvblocks.interop.zmq_events")
pytest.importorskip("zmq")

BATCHES, PER_BATCH = 50, 256
EVENTS_PER_ROUND = BATCHES * PER_BATCH
_rng = random.Random(7)
EVENTS = [
    BlockStored(
        (_rng.getrandbits(64),), None, "device", tuple(_rng.randrange(50_000) for _ in range(16)), 0, "full", 16
    )
    for _ in range(EVENTS_PER_ROUND)
]


def _consumer() -> tuple[Router, EventConsumer]:
    r = Router(["w"], RouterConfig(block_size=16))
    return r, EventConsumer(on_events=r.apply_events, on_snapshot=r.replace_index)


def _in_process() -> Iterator[Callable[[], None]]:
    sink = EventSink(capacity=EVENTS_PER_ROUND)
    transport = InProcessTransport(capacity=BATCHES * 2)
    publisher = EventPublisher("w", sink, transport, max_batch=PER_BATCH)
    _, consumer = _consumer()

    def round_trip() -> None:
        for e in EVENTS:
            sink.emit(e)
        publisher.publish()
        pump(transport, consumer, max_count=BATCHES * 2)
        if consumer.last_seq("w") != publisher.next_seq - 1:
            raise AssertionError("the in-process consumer fell behind")

    yield round_trip


def _over_zmq() -> Iterator[Callable[[], None]]:
    sink = EventSink(capacity=EVENTS_PER_ROUND)
    transport = zmq_events.ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv")
    sub = zmq_events.ZmqEventSubscriber(transport.endpoint, transport.replay_endpoint, worker="w", topic="kv")
    publisher = EventPublisher("w", sink, transport, max_batch=PER_BATCH)
    _, consumer = _consumer()

    def round_trip() -> None:
        for e in EVENTS:
            sink.emit(e)
        publisher.publish()
        deadline = time.monotonic() + 30
        while consumer.last_seq("w") != publisher.next_seq - 1:
            if time.monotonic() > deadline:
                raise AssertionError("the ZMQ subscriber fell behind")
            zmq_events.pump_subscriber(sub, consumer, timeout_s=0.05)

    try:
        yield round_trip
    finally:
        sub.close()
        transport.close()


@pytest.mark.parametrize("name", ["in-process", "zmq-vllm"])
def test_events_per_second(benchmark: pytest.FixtureRequest, name: str) -> None:
    make = _in_process if name == "in-process" else _over_zmq
    gen = make()
    round_trip = next(gen)
    try:
        round_trip()  # warm up (and, over ZMQ, the slow joiner: a late first batch is replayed)
        benchmark.group = "kv-events-transport"  # type: ignore[attr-defined]
        benchmark.pedantic(round_trip, rounds=5, iterations=1)  # type: ignore[attr-defined]
        if not benchmark.disabled:  # type: ignore[attr-defined]  # a disabled run (the test suite) has no stats
            median = benchmark.stats.stats.median  # type: ignore[attr-defined]
            benchmark.extra_info["events_per_s"] = round(EVENTS_PER_ROUND / median)  # type: ignore[attr-defined]
    finally:
        gen.close()


REPLAY_TIMEOUT_S = 0.2


def _gapped_stream(gaps: int, sockets: list[Any]) -> tuple[tuple[Any, EventConsumer], dict[str, Any]]:
    """A subscriber that has batch 0 and has ``gaps`` batches waiting, each after a lost one, from an engine
    whose replay socket (a ROUTER nobody reads) never answers."""
    import zmq

    from kvblocks.interop.engine_wire import encode_engine_batch

    ctx = zmq.Context.instance()
    pub, silent = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    sockets.extend([pub, silent])
    # no send high-water mark: a PUB drops what does not fit its queue (1,000 by default), and 1,000 gaps sent at
    # once lost one now and then on a loaded machine; unbounded, they wait for the SUB to take them
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind("tcp://127.0.0.1:*")
    silent.bind("tcp://127.0.0.1:*")
    sub = zmq_events.ZmqEventSubscriber(
        pub.getsockopt_string(zmq.LAST_ENDPOINT),
        silent.getsockopt_string(zmq.LAST_ENDPOINT),
        worker="w",
        topic="kv",
        replay_timeout_s=REPLAY_TIMEOUT_S,
    )
    sockets.append(sub)
    _, consumer = _consumer()

    def frame(k: int) -> list[bytes]:
        batch = EventBatch("w", k, 1.0, (BlockStored((k + 1,), None, "device", None, block_size=16),))
        return [b"kv", k.to_bytes(8, "big"), encode_engine_batch(batch)]

    deadline = time.monotonic() + 10
    while not sub._sub.poll(0):  # ZMQ's slow joiner: batch 0 until the SUB has it
        if time.monotonic() > deadline:
            raise AssertionError("the SUB socket did not connect")
        pub.send_multipart(frame(0))
        time.sleep(0.005)
    zmq_events.pump_subscriber(sub, consumer)
    for k in range(1, gaps + 1):
        pub.send_multipart(frame(2 * k))
    time.sleep(1.0)  # all of them in the SUB's queue (0.2 s was too short for 1,000 with CI's side builds running)
    return (sub, consumer), {}


@pytest.mark.parametrize("gaps", [30, 1000])
def test_one_pump_with_many_gaps_and_a_silent_replay_socket(benchmark: pytest.FixtureRequest, gaps: int) -> None:
    sockets: list[Any] = []
    fed: list[int] = []

    def one_pump(sub: Any, consumer: EventConsumer) -> None:
        fed.append(zmq_events.pump_subscriber(sub, consumer, timeout_s=0.01))

    try:
        benchmark.group = "kv-events-stall"  # type: ignore[attr-defined]
        benchmark.pedantic(one_pump, setup=lambda: _gapped_stream(gaps, sockets), rounds=3)  # type: ignore[attr-defined]
    finally:
        for s in sockets:
            s.close()
    if fed != [gaps] * len(fed):
        raise AssertionError(f"a pump did not take every gap: {fed}")
    if not benchmark.disabled:  # type: ignore[attr-defined]
        pump_s = benchmark.stats.stats.max  # type: ignore[attr-defined]
        benchmark.extra_info["pump_s"] = round(pump_s, 3)  # type: ignore[attr-defined]
        if pump_s > REPLAY_TIMEOUT_S + 1.0:
            raise AssertionError(f"one pump took {pump_s:.3f} s: more than one replay ({REPLAY_TIMEOUT_S} s)")
