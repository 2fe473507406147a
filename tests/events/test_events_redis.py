"""KV events through Redis Streams against a real redis-server (never a fake): workers publish,
routers on their own transport instances follow, a killed server costs a resync and nothing else."""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest

from kvblocks import AllBlocksCleared, EventSink
from kvblocks.errors import ConfigError
from kvblocks.events import EventBatch, EventPublisher, encode_batch
from kvblocks.events.transport import EventTransport, RedisStreamTransport, pump
from tests.support.event_index import Index, Workload, tree_view


def stream_name() -> str:
    return f"test-events-{uuid.uuid4().hex[:8]}"


def worker(url: str, stream: str, name: str, **kwargs) -> tuple[Workload, EventPublisher]:
    """A worker's cache and its publisher, on a transport of its own."""
    sink = EventSink()
    work = Workload(sink, num_blocks=10)
    transport = RedisStreamTransport(url, stream, **kwargs)
    return work, EventPublisher(name, sink, transport, max_batch=4, snapshot=work.m.tree.snapshot_events)


def test_routers_on_other_transports_follow_several_workers(redis_url) -> None:
    stream = stream_name()
    router = Index()
    reader = RedisStreamTransport(redis_url, stream)  # "$": what is published from now on
    assert isinstance(reader, EventTransport)
    workers = [worker(redis_url, stream, f"w{k}") for k in range(2)]
    rngs = [random.Random(10 + k) for k in range(2)]
    for _ in range(40):
        for (work, publisher), rng in zip(workers, rngs):
            work.run(rng, 3)
            publisher.publish()
        pump(reader, router.consumer)
        for work, publisher in workers:
            assert router.of.get(publisher.producer, {}) == tree_view(work.m.tree)
    assert router.consumer.gaps == router.consumer.duplicates == router.consumer.malformed == reader.errors == 0
    assert all(p.events_sent >= 20 and p.next_seq >= 20 for _, p in workers)  # the views saw real traffic
    assert all(router.consumer.last_seq(p.producer) == p.next_seq - 1 for _, p in workers)

    # A router reading the stream from its start rebuilds the same views.
    replay = Index()
    assert pump(RedisStreamTransport(redis_url, stream, start="0"), replay.consumer) == sum(
        p.next_seq for _, p in workers
    )
    assert replay.of == router.of

    # A router that joins late starts mid-stream: it asks for snapshots instead of holding partial views.
    late = Index()
    late_reader = RedisStreamTransport(redis_url, stream)
    for (work, publisher), rng in zip(workers, rngs):
        while not publisher.publish():
            work.run(rng, 1)
    pump(late_reader, late.consumer)
    assert late.consumer.needs_resync == {"w0", "w1"} and late.of == {}
    for _, publisher in workers:
        publisher.publish_snapshot()
    pump(late_reader, late.consumer)
    pump(reader, router.consumer)
    assert not late.consumer.needs_resync and late.of == router.of
    assert late.of == {p.producer: tree_view(w.m.tree) for w, p in workers}


def test_a_killed_server_costs_a_gap_and_a_resync_never_an_exception(private_redis) -> None:
    stream = stream_name()
    router = Index()
    reader = RedisStreamTransport(private_redis.url, stream, socket_timeout=0.5)
    work, publisher = worker(private_redis.url, stream, "w0", socket_timeout=0.5)
    rng = random.Random(2)
    for _ in range(5):
        work.run(rng, 4)
        publisher.publish()
    pump(reader, router.consumer)
    assert router.of["w0"] == tree_view(work.m.tree)
    sent_before = publisher.next_seq

    private_redis.stop()  # killed mid-run
    start = time.monotonic()
    for _ in range(5):
        while not publisher.publish():  # batches are lost, not raised
            work.run(rng, 1)
    assert pump(reader, router.consumer) == 0  # nothing to read, nothing raised
    assert reader.receive(timeout_s=0.2) == []  # a wait against a dead server waits, then gives up
    assert time.monotonic() - start < 10
    assert publisher.transport.errors == 5 and publisher.next_seq == sent_before + 5  # type: ignore[attr-defined]
    assert reader.errors >= 2 and router.consumer.gaps == 0

    private_redis.start()  # back, empty (no persistence)
    while not publisher.publish():
        work.run(rng, 1)
    pump(reader, router.consumer)
    assert router.gaps == [("w0", sent_before, sent_before + 5)] and router.consumer.needs_resync == {"w0"}
    publisher.publish_snapshot()  # the router asked (here: directly)
    pump(reader, router.consumer)
    assert not router.consumer.needs_resync and router.of["w0"] == tree_view(work.m.tree)
    for _ in range(5):  # and it follows again
        work.run(rng, 4)
        publisher.publish()
    pump(reader, router.consumer)
    assert router.of["w0"] == tree_view(work.m.tree) and router.consumer.gaps == 1


def test_a_reader_further_behind_than_maxlen_sees_a_gap(redis_url) -> None:
    stream = stream_name()
    reader = RedisStreamTransport(redis_url, stream)
    router = Index()
    sink = EventSink()
    transport = RedisStreamTransport(redis_url, stream, maxlen=10)
    publisher = EventPublisher("w0", sink, transport, max_batch=1)
    for _ in range(1000):
        sink.emit(AllBlocksCleared("device"))
    assert publisher.publish() == 1000
    assert transport._client.xlen(stream) < 1000  # trimmed (approximately: whole stream nodes)
    pump(reader, router.consumer)
    assert router.gaps and router.gaps[0][:2] == ("w0", 0) and router.consumer.needs_resync == {"w0"}


@pytest.mark.parametrize("socket_timeout", [0.2, 0.6])  # too short to block in (polls); blocks in slices
def test_waiting_receive_wakes_on_a_send_and_foreign_entries_are_counted(redis_url, socket_timeout) -> None:
    stream = stream_name()
    reader = RedisStreamTransport(redis_url, stream, socket_timeout=socket_timeout)
    writer = RedisStreamTransport(redis_url, stream)
    payload = encode_batch(EventBatch("w0", 0, 1.0, ()))
    timer = threading.Timer(0.5, writer.send, args=(payload,))
    start = time.monotonic()
    timer.start()
    assert reader.receive(timeout_s=3.0) == [payload]  # waits in slices shorter than the socket timeout
    assert 0.45 < time.monotonic() - start < 2.5
    start = time.monotonic()
    assert reader.receive(timeout_s=0.5) == [] and reader.errors == 0
    assert 0.45 < time.monotonic() - start < 2.0

    writer._client.xadd(stream, {"other": "app"})  # someone else's entry in the stream
    writer.send(encode_batch(EventBatch("w0", 1, 2.0, ())))
    router = Index()
    router.consumer.feed(EventBatch("w0", 0, 1.0, ()))
    assert pump(reader, router.consumer) == 1
    assert router.consumer.malformed == 1 and router.consumer.last_seq("w0") == 1
    reader.close()
    writer.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"url": "http://nowhere"},
        {"stream": ""},
        {"maxlen": 0},
        {"maxlen": 1.5},
        {"socket_timeout": 0},
        {"start": "latest"},
        {"start": "12-x"},
    ],
)
def test_bad_configuration(redis_url, kwargs) -> None:
    args = {"url": redis_url} | kwargs
    with pytest.raises(ConfigError):
        RedisStreamTransport(**args)


def test_explicit_start_ids_are_accepted(redis_url) -> None:
    stream = stream_name()
    writer = RedisStreamTransport(redis_url, stream)
    writer.send(b"a")
    writer.send(b"b")
    first = writer._client.xrange(stream, count=1)[0][0].decode()
    assert RedisStreamTransport(redis_url, stream, start=first).receive() == [b"b"]
    assert RedisStreamTransport(redis_url, stream, start="0").receive() == [b"a", b"b"]
