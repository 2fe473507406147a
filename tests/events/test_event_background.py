"""KV events off the engine thread: ``EventSink.record`` (built only when read) and background publishing.

The oracle for the lazy path is the eager one: the same work on a twin manager whose sink has a subscriber
(so every event is built at once, as ``emit`` does) gives the events the background publisher must deliver,
number for number -- however late it builds them. Consumers are the strict index of
``tests/support/event_index.py``: an event applied twice, out of order or after an unnoticed loss raises.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvblocks.errors import ConfigError
from kvblocks.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventPublisher,
    EventRecord,
    EventSink,
    KVEvent,
)
from kvblocks.events.codec import build_pending
from kvblocks.events.transport import InProcessTransport, pump
from tests.support.event_index import Index, Workload, tree_view


def ticking() -> Callable[[], float]:
    """A fake clock: 100.0, 100.5, 101.0, ..."""
    ticks = iter(range(10**9))
    return lambda: 100.0 + next(ticks) / 2


# ---------------------------------------------------------------------- record vs emit


def test_record_numbers_and_stamps_like_emit_and_builds_only_when_drained() -> None:
    built: list[tuple[Any, ...]] = []

    def make(hashes: Any, parent: Any = None, tokens: Any = None, lora: Any = None) -> BlockStored:
        return BlockStored(tuple(hashes), parent, "host", tokens, lora_name=lora)

    def counted(*args: Any) -> BlockStored:
        built.append(args)
        return make(*args)

    lazy, eager = EventSink(clock=ticking()), EventSink(clock=ticking())
    calls: list[tuple[Any, ...]] = [((1, 2),), ((3,), 2), ((b"\x07" * 16,), None, (5, 6)), ((9,), 3, (), "lora-a")]
    for args in calls:
        lazy.record(counted, *args)
        eager.emit(make(*args))
    lazy.record(AllBlocksCleared, "device")
    eager.emit(AllBlocksCleared("device"))
    assert built == [] and lazy.next_seq == eager.next_seq == 5  # numbered now, built later
    records = lazy.drain()
    assert records == eager.drain()
    assert [(r.seq, r.timestamp) for r in records] == [(k, 100.0 + k / 2) for k in range(5)]
    assert built == calls  # exactly the arguments given: none left out is passed (no NO_ARG leaks in)
    assert lazy.drain() == []


def test_a_subscriber_sees_a_record_at_once_built_and_numbered_in_order_with_emits() -> None:
    sink = EventSink(clock=ticking())
    sink.record(lambda h: BlockRemoved(tuple(h), "device"), [1])  # before subscribing: stays unbuilt
    seen: list[EventRecord] = []
    sink.subscribe(seen.append)
    sink.record(lambda h, t: BlockRemoved(tuple(h), t), [2], "host")
    assert seen == [EventRecord(1, 100.5, BlockRemoved((2,), "host"))]
    sink.emit(AllBlocksCleared("device"))
    sink.record(lambda h: BlockRemoved(tuple(h), "storage"), (3, 4))
    assert [r.seq for r in seen] == [1, 2, 3] and seen[-1].event == BlockRemoved((3, 4), "storage")
    assert [(r.seq, r.event) for r in sink.drain()] == [
        (0, BlockRemoved((1,), "device")),
        (1, BlockRemoved((2,), "host")),
        (2, AllBlocksCleared("device")),
        (3, BlockRemoved((3, 4), "storage")),
    ]


def test_overflow_of_records_drops_the_oldest_and_the_publisher_skips_a_number() -> None:
    sink = EventSink(capacity=3, clock=ticking())
    transport: list[EventBatch] = []
    publisher = EventPublisher("w0", sink, _Collect(transport))
    sink.record(AllBlocksCleared, "device")
    publisher.publish()

    def removed(h: int) -> BlockRemoved:
        return BlockRemoved((h,), "device")

    for k in range(7):  # 7 into a buffer of 3, recorded and emitted in turn: records 1..4 lost
        if k % 2:
            sink.record(removed, k)
        else:
            sink.emit(removed(k))
    assert publisher.publish() == 1
    assert publisher.records_lost == 4 and publisher.next_seq == 3
    assert [b.seq for b in transport] == [0, 2]
    assert [e.block_hashes for e in transport[1].events] == [(4,), (5,), (6,)]  # type: ignore[union-attr]
    assert transport[0].events == (AllBlocksCleared("device"),)


# ---------------------------------------------------------------------- helpers: transports


class _Collect:
    """A transport that keeps the batches it is handed (``send_batch``), from whichever thread."""

    def __init__(self, out: list[EventBatch]) -> None:
        self.out = out
        self.threads: set[str] = set()

    def send_batch(self, batch: EventBatch) -> None:
        self.threads.add(threading.current_thread().name)
        self.out.append(batch)

    def send(self, data: bytes) -> None:  # pragma: no cover - send_batch is preferred
        raise AssertionError("send_batch expected")


class _Pending(_Collect):
    """Keeps the unbuilt entries a publisher hands over (``send_pending``): built at the very end of the test."""

    def __init__(self, out: list[EventBatch]) -> None:
        super().__init__(out)
        self.pending: list[tuple[int, float, list[Any]]] = []

    def send_pending(self, producer: str, seq: int, timestamp: float, entries: list[Any]) -> None:
        self.threads.add(threading.current_thread().name)
        self.pending.append((seq, timestamp, entries))


# ---------------------------------------------------------------------- threaded stress


@pytest.fixture
def busy_switching() -> Iterator[None]:
    """Hand the GIL over often, so the background thread interleaves with the recording thread."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.usefixtures("busy_switching")
def test_background_publishing_delivers_every_record_once_in_order_even_built_late(seed: int) -> None:
    """The recording thread works, snapshots now and then; a background thread drains every 0.2 ms.

    After stop(): batch numbers are 0, 1, 2, ... with no gap; each plain batch holds the next records in
    order (numbers contiguous from the previous batch or from the last snapshot's point); built only now,
    they equal the twin's eagerly built events; a consumer's view equals the tree.
    """
    sink, twin_sink = EventSink(), EventSink()
    work, twin = Workload(sink, num_blocks=10), Workload(twin_sink, num_blocks=10)
    eager: list[EventRecord] = []
    twin_sink.subscribe(eager.append)
    batches: list[EventBatch] = []
    transport = _Pending(batches)
    publisher = EventPublisher("w0", sink, transport, max_batch=5, snapshot=work.m.tree.snapshot_events)
    marks: list[tuple[int, list[BlockStored]]] = []  # (records before it, its content) per snapshot
    rng = random.Random(seed)
    publisher.start(0.0002)
    try:
        for step in range(1500):
            op, pick, size = rng.randrange(4), rng.randrange(100), rng.randrange(8)
            work.step(op, pick, size)
            twin.step(op, pick, size)
            if step % 150 == 149:  # a resync asked for, answered from the recording thread
                before = sink.next_seq
                publisher.publish_snapshot()
                marks.append((before, work.m.tree.snapshot_events()))
            if step % 50 == 0:
                time.sleep(0.0005)
    finally:
        publisher.stop()
    assert not publisher.running and publisher.errors == 0 and publisher.records_lost == 0
    assert "kvblocks-events-w0" in transport.threads  # rounds ran in the background
    numbered: dict[int, Any] = {seq: ("pending", ts, entries) for seq, ts, entries in transport.pending}
    numbered.update({b.seq: ("snapshot", b) for b in batches})
    assert len(numbered) == len(transport.pending) + len(batches) == publisher.next_seq == publisher.batches_sent
    assert sorted(numbered) == list(range(publisher.next_seq))

    index = Index()
    expected_record, snapshots = 0, iter(marks)
    for seq in range(publisher.next_seq):
        item = numbered[seq]
        if item[0] == "snapshot":
            before, content = next(snapshots)
            assert item[1].snapshot and list(item[1].events) == content
            expected_record = before  # what was buffered is inside the snapshot
            index.consumer.feed(item[1])
            continue
        _, ts, entries = item
        numbers = [e[0] for e in entries]
        assert numbers == list(range(expected_record, expected_record + len(numbers))) and 0 < len(numbers) <= 5
        events = tuple(build_pending(entries))  # built now, long after recording
        assert events == tuple(eager[n].event for n in numbers)
        assert ts == entries[-1][1]  # the newest event's time
        expected_record += len(numbers)
        index.consumer.feed(EventBatch("w0", seq, ts, events))
    assert expected_record == sink.next_seq == twin_sink.next_seq and next(snapshots, None) is None
    assert len(marks) == 10
    assert index.consumer.gaps == 0 and not index.consumer.needs_resync
    assert index.of["w0"] == tree_view(work.m.tree) == tree_view(twin.m.tree)


@pytest.mark.usefixtures("busy_switching")
def test_a_tight_record_loop_loses_and_repeats_nothing_while_the_background_drains() -> None:
    """100k records as fast as the thread can, drained every 50 us: each record number exactly once, in order."""
    sink = EventSink()
    batches: list[EventBatch] = []
    transport = _Pending(batches)
    publisher = EventPublisher("w0", sink, transport, max_batch=1000)
    publisher.start(0.00005)
    record = sink.record
    for k in range(100_000):
        record(BlockRemoved, (k,), "device")
    publisher.stop()
    assert len(transport.pending) > 2  # drained several times meanwhile
    assert [seq for seq, _, _ in transport.pending] == list(range(publisher.next_seq))
    assert [e[0] for _, _, entries in transport.pending for e in entries] == list(range(100_000))
    assert [e.block_hashes for _, _, entries in transport.pending for e in build_pending(entries)] == [
        (k,) for k in range(100_000)
    ]  # type: ignore[union-attr]


@pytest.mark.usefixtures("busy_switching")
def test_in_process_transport_in_the_background_keeps_a_pumping_consumer_in_sync() -> None:
    """Events built and JSON-encoded on the background thread; a router thread pumps all the while."""
    sink = EventSink()
    work = Workload(sink, num_blocks=12)
    transport = InProcessTransport()
    index = Index()
    done = threading.Event()

    def router() -> None:
        while not done.is_set():
            pump(transport, index.consumer, timeout_s=0.001)

    pumping = threading.Thread(target=router, name="router")
    pumping.start()
    with EventPublisher("w0", sink, transport, max_batch=3, snapshot=work.m.tree.snapshot_events) as publisher:
        publisher.start(0.0003)
        rng = random.Random(9)
        for step in range(1200):
            work.run(rng, 1)
            if step % 300 == 299:
                publisher.publish_snapshot()
    assert not publisher.running  # __exit__ stopped it and published the rest
    done.set()
    pumping.join()
    pump(transport, index.consumer)
    assert index.consumer.last_seq("w0") == publisher.next_seq - 1 == publisher.batches_sent - 1
    assert index.consumer.gaps == 0 and index.consumer.batches == publisher.next_seq
    assert index.of["w0"] == tree_view(work.m.tree) and publisher.snapshots_sent == 4


# ---------------------------------------------------------------------- start / stop rules, failures


def test_start_twice_and_bad_intervals_are_config_errors() -> None:
    publisher = EventPublisher("w0", EventSink(), InProcessTransport())
    for bad in [0, -1, 0.0, 60.5, float("nan"), float("inf"), True, "0.1", None]:
        with pytest.raises(ConfigError):
            publisher.start(bad)  # type: ignore[arg-type]
        assert not publisher.running
    publisher.start(60)
    try:
        assert publisher.running
        with pytest.raises(ConfigError):
            publisher.start(0.01)
    finally:
        publisher.stop()
    assert not publisher.running
    publisher.stop()  # a second stop is harmless
    assert not any(t.name == "kvblocks-events-w0" for t in threading.enumerate())


def test_stop_waits_for_a_round_in_progress_then_publishes_the_rest_on_the_caller() -> None:
    entered, release = threading.Event(), threading.Event()
    batches: list[EventBatch] = []

    class Slow(_Collect):
        def send_batch(self, batch: EventBatch) -> None:
            if batch.seq == 0:
                entered.set()
                release.wait(5)
                time.sleep(0.05)
            super().send_batch(batch)

    sink = EventSink()
    transport = Slow(batches)
    publisher = EventPublisher("w0", sink, transport)
    sink.record(AllBlocksCleared, "device")
    publisher.start(0.001)
    assert entered.wait(5)  # the background round is inside send_batch now
    sink.record(AllBlocksCleared, "host")
    threading.Timer(0.05, release.set).start()
    publisher.stop()
    assert [b.seq for b in batches] == [0, 1]  # the round finished before stop returned, then the rest
    assert transport.threads == {"kvblocks-events-w0", threading.current_thread().name}
    assert batches[1].events == (AllBlocksCleared("host"),)


def test_a_round_that_raises_is_counted_logged_and_the_next_rounds_go_on(caplog: pytest.LogCaptureFixture) -> None:
    batches: list[EventBatch] = []
    fail = threading.Event()

    class Flaky(_Collect):
        calls = 0

        def send_batch(self, batch: EventBatch) -> None:
            self.calls += 1
            if fail.is_set():
                fail.clear()
                raise OSError("link down")
            super().send_batch(batch)

    sink = EventSink()
    transport = Flaky(batches)
    publisher = EventPublisher("w0", sink, transport)
    index = Index()
    caplog.set_level(logging.ERROR, logger="kvblocks.events")

    def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 5
        while not condition():
            assert time.monotonic() < deadline, "condition not reached in time"
            time.sleep(0.001)

    publisher.start(0.001)
    try:
        sink.record(lambda h: BlockStored((h,), None, "device"), 1)
        until(lambda: len(batches) == 1)
        fail.set()
        sink.record(lambda h: BlockStored((h,), 1, "device"), 2)
        until(lambda: publisher.errors == 1 and "a background round failed" in caplog.text)  # counted, then logged
        assert publisher.running and "link down" in caplog.text
        sink.record(lambda h: BlockStored((h,), None, "device"), 3)
        until(lambda: len(batches) == 2)
    finally:
        publisher.stop()
    assert [b.seq for b in batches] == [0, 3]  # batch 1 failed (and 2 is skipped: it may have half-left)
    assert publisher.errors == 1 and transport.calls == 3
    for b in batches:
        index.consumer.feed(b)
    assert index.gaps == [("w0", 1, 3)] and index.consumer.needs_resync == {"w0"}


# ---------------------------------------------------------------------- over ZMQ: the publisher's own thread


def _zmq() -> Any:
    pytest.importorskip("msgspec")
    return pytest.importorskip("zmq")


PROBE_SEQ = 2**62  # a wire seq no test batch reaches: what the SUB receives while it joins


def _joined_sub(zmq: Any, pub: Any) -> Any:
    """A SUB socket on ``pub`` that is known to receive (ZMQ's slow joiner: probes until one arrives)."""
    from kvblocks.interop.zmq_events import ZmqEventPublisher

    assert isinstance(pub, ZmqEventPublisher)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)  # keep every message until the test reads them
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    deadline = time.monotonic() + 5
    while not sub.poll(5):
        assert time.monotonic() < deadline, "the SUB never joined"
        pub.send_batch(EventBatch("probe", PROBE_SEQ, 0.0, ()))
    return sub


def _wire_form(event: KVEvent) -> list[KVEvent]:
    """What a vLLM-dialect payload decodes to: int hashes, no unknown fields, a clear of every tier."""
    from kvblocks.hashing import vllm_int_hash

    if isinstance(event, AllBlocksCleared):
        return [AllBlocksCleared(t) for t in ("device", "host", "storage")]
    hashes = tuple(vllm_int_hash(h) for h in event.block_hashes)
    if isinstance(event, BlockRemoved):
        return [BlockRemoved(hashes, event.tier, event.group, event.group_kind)]
    parent = None if event.parent_hash is None else vllm_int_hash(event.parent_hash)
    tokens = tuple(event.token_ids) if event.token_ids else None
    return [
        BlockStored(
            hashes, parent, event.tier, tokens, event.group, event.group_kind, event.block_size, None, event.lora_name
        )
    ]


@pytest.mark.usefixtures("busy_switching")
def test_zmq_publishing_in_the_background_runs_on_the_publishers_thread_and_delivers_every_event() -> None:
    zmq = _zmq()
    from kvblocks.interop.engine_wire import decode_engine_batch
    from kvblocks.interop.zmq_events import ZmqEventPublisher

    sink, twin_sink = EventSink(), EventSink()
    work, twin = Workload(sink, num_blocks=10), Workload(twin_sink, num_blocks=10)
    eager: list[EventRecord] = []
    twin_sink.subscribe(eager.append)
    with ZmqEventPublisher("tcp://127.0.0.1:*", topic="kv") as pub:
        sub = _joined_sub(zmq, pub)
        try:
            publisher = EventPublisher("w0", sink, pub, max_batch=7)
            periodic: list[tuple[Any, float]] = []
            rounds_on: set[str] = set()
            run_periodically = pub.run_periodically

            def spy(round_fn: Callable[[], object], interval_s: float) -> Callable[[], None]:
                periodic.append((round_fn, interval_s))

                def traced() -> object:
                    rounds_on.add(threading.current_thread().name)
                    return round_fn()

                return run_periodically(traced, interval_s)

            pub.run_periodically = spy  # type: ignore[method-assign]
            publisher.start(0.0005)
            assert len(periodic) == 1 and periodic[0][1] == 0.0005
            assert not any(t.name.startswith("kvblocks-events") for t in threading.enumerate())  # no thread of its own
            rng = random.Random(4)
            for step in range(600):
                op, pick, size = rng.randrange(4), rng.randrange(100), rng.randrange(8)
                work.step(op, pick, size)
                twin.step(op, pick, size)
                if step % 100 == 0:
                    time.sleep(0.002)
            publisher.stop()
            assert pub.flush() and pub.errors == pub.dropped == 0
            assert rounds_on == {"kvblocks-zmq-events"} and publisher.errors == 0
            frames = []
            while sub.poll(200):
                frames.append(sub.recv_multipart())
        finally:
            sub.close(linger=0)
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    payloads = [f[2] for f, s in zip(frames, seqs, strict=True) if s != PROBE_SEQ]
    assert [s for s in seqs if s != PROBE_SEQ] == list(range(publisher.next_seq))
    assert {f[0] for f in frames} == {b"kv"} and len(eager) == sink.next_seq > 100
    decoded = [e for p in payloads for e in decode_engine_batch(p, "vllm").events]
    assert decoded == [w for r in eager for w in _wire_form(r.event)]


def test_zmq_stop_returns_only_when_no_round_is_running() -> None:
    _zmq()
    from kvblocks.interop.zmq_events import ZmqEventPublisher

    with ZmqEventPublisher("tcp://127.0.0.1:*") as pub:
        sink = EventSink()
        publisher = EventPublisher("w0", sink, pub)
        inside, finished = threading.Event(), threading.Event()
        after_stop: list[int] = []
        run_periodically = pub.run_periodically

        def slow(round_fn: Callable[[], object], interval_s: float) -> Callable[[], None]:
            def round_() -> None:
                inside.set()
                time.sleep(0.1)
                round_fn()
                finished.set()
                after_stop.append(1)

            return run_periodically(round_, interval_s)

        pub.run_periodically = slow  # type: ignore[method-assign]
        publisher.start(0.001)
        assert inside.wait(5)
        inside.clear()
        publisher.stop()
        assert finished.is_set()  # the round in progress ended before stop returned
        rounds = len(after_stop)
        time.sleep(0.05)
        assert len(after_stop) == rounds and not inside.is_set()  # and none ran since
        assert not publisher.running
