"""KV events published and consumed over ZMQ on loopback in vLLM's wire, against the in-process transport.

One round: 12,800 ``BlockStored`` events (one 64-bit hash and 16 token ids each, as vLLM's events carry)
go into a sink, an :class:`EventPublisher` sends them as 50 batches of 256, and the consumer side applies
them to a :class:`Router` -- through :class:`InProcessTransport` and :func:`pump` (kvblocks' JSON), or through
:class:`ZmqEventPublisher` -> PUB/SUB on 127.0.0.1 -> :class:`ZmqEventSubscriber` -> :func:`pump_subscriber`
(vLLM's msgpack; the publisher's thread encodes and sends). ``extra_info["events_per_s"]`` is the figure.

    python -m pytest benchmarks/test_bench_zmq_events.py --benchmark-enable -q
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest

from kvblocks.event_transport import InProcessTransport, pump
from kvblocks.events import BlockStored, EventConsumer, EventPublisher, EventSink
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
