"""KV events: what a cache tier stored, removed or cleared, numbered in emission order.

A :class:`kvblocks.radix.PrefixTree` emits one event per batch it changes (one
``BlockStored`` per insert call, one ``BlockRemoved`` per eviction call), carrying
block hashes -- the same keys a router or indexer uses. In a hybrid model's cache each
group emits its own events, tagged with the group's index and kind (``group``,
``group_kind``): the full-attention group's tree and each local group's
:class:`kvblocks.hybrid.block_index.FlatBlockIndex`. The groups share one key space, so
a consumer that tracks the prefix follows the ``"full"`` group (and untagged events)
only; a window group's removal of a hash says nothing about the full group's copy. An :class:`EventSink`
numbers them 0, 1, 2, ... and delivers them in process: to subscribers as they
happen and to a bounded buffer for polling. A consumer that sees a gap in the
numbers knows it missed events and must resynchronise.

Across processes and machines, events travel in :class:`EventBatch` es::

    manager -> EventSink -> EventPublisher --bytes--> transport --bytes--> pump -> EventConsumer
                              (numbers batches 0, 1, 2, ...          (detects gaps, asks for
                               per producer; encode_batch)            a resync, applies snapshots)

A cache records its events on its hot path with :meth:`EventSink.record` (a factory and its
arguments: the event is built only when read). An :class:`EventPublisher` drains a sink and sends
its records as batches numbered per producer -- when the engine calls :meth:`EventPublisher.publish`,
or every few milliseconds from a background thread after :meth:`EventPublisher.start`, which takes
building, batching and sending off the engine's thread; :meth:`EventPublisher.publish_snapshot`
sends the producer's whole tree (:meth:`kvblocks.radix.PrefixTree.snapshot_events`; for a hybrid cache, followed by
each local group's :meth:`~kvblocks.hybrid.block_index.FlatBlockIndex.snapshot_events`,
all tagged) as one batch that replaces what consumers knew of it. An :class:`EventConsumer` applies batches in order and
reports a missing number as a gap; it then ignores that producer's batches until a
snapshot arrives. Any loss -- a full sink buffer, a dropped message, a transport
that was down -- therefore shows as a gap, never as a silently wrong view.
Transports live in :mod:`kvblocks.event_transport`.

The event types, :class:`EventBatch` and the wire format (:func:`encode_batch`,
:func:`decode_batch`) live in :mod:`kvblocks.event_codec`, the layer below both this
module and the transports; they are re-exported here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from kvblocks.errors import ConfigError
from kvblocks.event_codec import (
    EVENT_FORMAT_VERSION,
    EVENT_GROUP_KINDS,
    MAX_BATCH_SEQ,
    NO_ARG,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    PendingEvent,
    build_pending,
    decode_batch,
    encode_batch,
    pending_args,
    removed_event,
    stored_event,
)
from kvblocks.hashing import BlockHash

if TYPE_CHECKING:  # the transport layer is below this one (and never imports it)
    from kvblocks.event_transport import EventTransport

__all__ = [
    "EVENT_FORMAT_VERSION",
    "EVENT_GROUP_KINDS",
    "MAX_BATCH_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventConsumer",
    "EventPublisher",
    "EventRecord",
    "EventSink",
    "KVEvent",
    "decode_batch",
    "encode_batch",
    "record_changes",
]

_log = logging.getLogger("kvblocks.events")


@dataclass(slots=True, unsafe_hash=True)  # a value, never modified; not frozen: see kvblocks.event_codec.KVEvent
class EventRecord:
    """An event with its sequence number (0, 1, 2, ... per sink) and wall-clock timestamp."""

    seq: int
    timestamp: float
    event: KVEvent


class EventSink:
    """Numbers events and delivers them in process.

    >>> sink = EventSink()
    >>> seen = []
    >>> unsubscribe = sink.subscribe(seen.append)
    >>> sink.emit(AllBlocksCleared(tier="device")).seq
    0
    >>> [r.seq for r in sink.drain()], len(seen)
    ([0], 1)

    ``capacity`` bounds the polling buffer: when it is full the oldest record is
    dropped (a poller then sees a gap). Subscribers are called synchronously, in
    subscription order. A subscriber that raises is logged and counted in
    ``subscriber_errors``; the exception never reaches the cache operation that
    emitted the event, which has already changed the cache.

    A cache on its hot path calls :meth:`record` instead of :meth:`emit`: the event's
    class and arguments are buffered and the event is built only when somebody reads
    it -- at once for subscribers, at :meth:`drain`, or on a background transport's own
    thread (:meth:`EventPublisher.publish`). Numbers and timestamps are taken when the
    event is recorded either way.
    """

    __slots__ = ("_buffer", "_clock", "_next_seq", "_subscribers", "subscriber_errors")

    def __init__(self, capacity: int = 65536, *, clock: Callable[[], float] = time.time) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"event buffer capacity must be an int >= 0, got {capacity!r}")
        self._next_seq = 0
        # one PendingEvent per event, oldest first: (seq, timestamp, factory, *args), or (seq, timestamp, None, event)
        self._buffer: deque[PendingEvent] = deque(maxlen=capacity)
        self._subscribers: list[Callable[[EventRecord], None]] = []
        self._clock = clock
        self.subscriber_errors = 0

    @property
    def next_seq(self) -> int:
        """The number the next event will get."""
        return self._next_seq

    def subscribe(self, callback: Callable[[EventRecord], None]) -> Callable[[], None]:
        """Call ``callback`` with every later record; returns a function that unsubscribes it."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def emit(self, event: KVEvent) -> EventRecord:
        """Number ``event``, buffer it and hand it to every subscriber; return its record."""
        seq = self._next_seq
        record = EventRecord(seq, self._clock(), event)
        self._next_seq = seq + 1
        self._buffer.append((seq, record.timestamp, None, event))
        for callback in self._subscribers:
            try:
                callback(record)
            except Exception:
                self.subscriber_errors += 1
                _log.exception("KV event subscriber %r failed on event %d", callback, record.seq)
        return record

    def record(
        self,
        factory: Callable[..., KVEvent],
        a: object,
        b: object = NO_ARG,
        c: object = NO_ARG,
        d: object = NO_ARG,
        e: object = NO_ARG,
    ) -> None:
        """Emit ``factory(a, b, c, d, e)``, built only when read (see the class docstring); arguments left
        out are not passed. What the event is built from must not change later. At most five, held in the
        entry itself: one object per event for the garbage collector to count, where ``*args`` would make
        two."""
        if self._subscribers:
            self.emit(factory(*pending_args((0, 0.0, factory, a, b, c, d, e))))
            return
        seq = self._next_seq
        self._buffer.append((seq, self._clock(), factory, a, b, c, d, e))
        self._next_seq = seq + 1

    def drain(self) -> list[EventRecord]:
        """Return and forget the buffered records, oldest first."""
        entries = self._take()
        return [EventRecord(e[0], e[1], event) for e, event in zip(entries, build_pending(entries))]

    def _take(self) -> list[PendingEvent]:
        """Remove and return the buffered entries, unbuilt, oldest first.

        One event at a time (``popleft``): a thread draining the sink never loses an event the cache's
        thread records meanwhile, which a copy-then-clear could.
        """
        buffer = self._buffer
        popleft = buffer.popleft
        return [popleft() for _ in range(len(buffer))]


def record_changes(
    sink: EventSink,
    changes: list[tuple[bool, list[BlockHash]]],
    tier: str,
    group: int | None,
    group_kind: str | None,
    block_size: int | None,
) -> None:
    """Record a tier's noted changes in order: each ``(stored, hashes)`` run as one ``BlockStored`` (no parent,
    no token ids: a lower tier holds blocks, not chains) or one ``BlockRemoved``. The lists become the events'
    hashes: the caller hands them over and does not change them again."""
    stored = partial(stored_event, tier, group, group_kind, block_size)
    removed = partial(removed_event, tier, group, group_kind)
    for is_stored, hashes in changes:
        if is_stored:
            sink.record(stored, hashes, None, None, None)
        else:
            sink.record(removed, hashes)


# ---------------------------------------------------------------------- publisher


class EventPublisher:
    """Sends a sink's records as numbered batches of one producer through a transport.

    Two ways to drive it:

    * Call :meth:`publish` from the thread that drives the cache (for example once per engine
      step): it drains ``sink`` and sends the records in batches of at most ``max_batch`` events.
    * Or call :meth:`start` once: a background thread publishes every ``interval_s``, and the cache's
      thread pays only for recording its events (:meth:`EventSink.record`) -- the events are built,
      batched and handed to the transport off it. Batches then hold what accumulated in an interval
      rather than one engine step; consumers see the same events in the same order. :meth:`stop`
      publishes what is left and ends the thread.

    The publisher must be its sink's only drainer. :meth:`publish` and :meth:`publish_snapshot` may be
    called from any thread; a lock keeps one at a time (the cache's thread may call them while a
    background thread runs, and waits for a send in progress).

    Batches are numbered 0, 1, 2, ... Nothing is hidden from consumers: when the sink buffer
    overflowed (drained record numbers do not continue the previous drain), the publisher skips one
    batch number, so consumers see a gap and ask for a resync; a batch a transport failed to deliver
    leaves a gap the same way. :meth:`publish_snapshot` answers a resync: the producer's whole cache
    in one batch (not split by ``max_batch``).

    A transport that has a ``send_batch(batch)`` method gets the :class:`EventBatch` itself instead of
    :func:`encode_batch` bytes: it writes its own wire format (:mod:`kvblocks.interop`) and numbers its
    messages with ``batch.seq``, so a gap here is a gap on its wire too.

    A publisher created for a cache that already holds blocks should start with
    :meth:`publish_snapshot`: consumers accept a producer's first batch without a
    snapshot only when it is batch 0.
    """

    __slots__ = (
        "_expected_record",
        "_halt",
        "_lock",
        "_seq",
        "_sink",
        "_snapshot",
        "batches_sent",
        "errors",
        "events_sent",
        "max_batch",
        "producer",
        "records_lost",
        "snapshots_sent",
        "transport",
    )

    def __init__(
        self,
        producer: str,
        sink: EventSink,
        transport: EventTransport,
        *,
        max_batch: int = 256,
        snapshot: Callable[[], Sequence[KVEvent]] | None = None,
    ) -> None:
        if type(producer) is not str or not producer:
            raise ConfigError(f"producer must be a non-empty str, got {producer!r}")
        if type(max_batch) is not int or max_batch < 1:
            raise ConfigError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if not isinstance(sink, EventSink):
            raise ConfigError(f"sink must be an EventSink, got {type(sink).__name__}")
        self.producer = producer
        self.transport = transport
        self.max_batch = max_batch
        self._sink = sink
        self._snapshot = snapshot
        self._seq = 0
        # The record number the next drain should start with: records lost before then are no gap of ours.
        buffered = sink._buffer
        self._expected_record = buffered[0][0] if buffered else sink.next_seq
        self._lock = threading.Lock()
        self._halt: Callable[[], None] | None = None  # ends background publishing (start)
        self.batches_sent = 0
        """Batches handed to the transport (snapshots included)."""
        self.events_sent = 0
        self.snapshots_sent = 0
        self.records_lost = 0
        """Records the sink dropped before this publisher could drain them (each loss also skips a batch number)."""
        self.errors = 0
        """Rounds of the background thread that raised (logged; the batch is a gap downstream)."""

    @property
    def next_seq(self) -> int:
        """The number the next batch will get."""
        return self._seq

    def _send(self, events: tuple[KVEvent, ...], timestamp: float, snapshot: bool) -> None:
        batch = EventBatch(self.producer, self._seq, timestamp, events, snapshot)
        send_batch = getattr(self.transport, "send_batch", None)
        if send_batch is not None:  # a transport with a wire format of its own (vLLM's msgpack over ZMQ)
            self._deliver(len(events), send_batch, batch)
        else:
            self._deliver(len(events), self.transport.send, encode_batch(batch))

    def _deliver(self, count: int, send: Callable[..., object], *payload: object) -> None:
        self._seq += 1  # taken even if sending fails: an undelivered batch is a gap downstream
        try:
            send(*payload)
        except BaseException:
            self._seq += 1  # the transport may have delivered it and lost what follows: force a gap
            raise
        self.batches_sent += 1
        self.events_sent += count

    def publish(self) -> int:
        """Drain the sink and send its records; return the number of batches sent.

        A transport with a ``send_pending(producer, seq, timestamp, entries)`` method gets each batch's
        events unbuilt (:data:`~kvblocks.event_codec.PendingEvent` entries) and builds them one at a time
        as it encodes them (:func:`~kvblocks.event_codec.build_pending`), so they never all live at once.
        """
        with self._lock:
            entries = self._sink._take()
            if not entries:
                return 0
            first = entries[0][0]
            if first != self._expected_record:
                self.records_lost += max(0, first - self._expected_record)
                self._seq += 1  # the lost records: consumers see a gap and ask for a resync
                _log.warning(
                    "KV event publisher %r: records %d..%d were dropped by the sink; consumers will see a gap",
                    self.producer,
                    self._expected_record,
                    first - 1,
                )
            self._expected_record = entries[-1][0] + 1
            send_pending = getattr(self.transport, "send_pending", None)
            sent = 0
            size = self.max_batch
            for k in range(0, len(entries), size):
                chunk = entries[k : k + size]
                if send_pending is not None:
                    self._deliver(len(chunk), send_pending, self.producer, self._seq, chunk[-1][1], chunk)
                else:
                    self._send(tuple(build_pending(chunk)), chunk[-1][1], False)
                sent += 1
            return sent

    def publish_snapshot(self) -> None:
        """Send the producer's whole cache as a snapshot batch (the next number).

        Call it from the thread that drives the cache (the snapshot reads it). Records still buffered
        in the sink are discarded: the snapshot already reflects them, and replaying them after it
        would apply them twice.
        """
        if self._snapshot is None:
            raise ConfigError(f"publisher {self.producer!r} has no snapshot callable")
        with self._lock:
            sink = self._sink
            sink._take()
            events = tuple(self._snapshot())
            self._expected_record = sink.next_seq
            self._send(events, sink._clock(), True)
            self.snapshots_sent += 1

    # -- the background thread

    def start(self, interval_s: float = 0.005) -> None:
        """Publish every ``interval_s`` seconds from a background thread until :meth:`stop`.

        A transport with a thread of its own that offers ``run_periodically(round, interval_s)`` (the ZMQ
        publisher) runs the rounds on that thread; otherwise the publisher starts one. Every thread that
        wakes takes the GIL from the engine's thread for a while, so one is better than two. A round
        never raises: one whose transport raised is logged and counted in :attr:`errors`, and the batch
        it lost is a gap downstream, as with :meth:`publish`.
        """
        if isinstance(interval_s, bool) or not isinstance(interval_s, int | float) or not 0 < interval_s <= 60:
            raise ConfigError(f"interval_s must be a number in (0, 60], got {interval_s!r}")
        if self._halt is not None:
            raise ConfigError(f"publisher {self.producer!r} is already publishing in the background")
        run_periodically = getattr(self.transport, "run_periodically", None)
        if run_periodically is not None:
            self._halt = run_periodically(self._round, float(interval_s))
            return
        stop = threading.Event()
        thread = threading.Thread(
            target=self._run, args=(stop, float(interval_s)), name=f"kvblocks-events-{self.producer}", daemon=True
        )

        def halt() -> None:
            stop.set()
            thread.join()

        thread.start()
        self._halt = halt

    def stop(self) -> None:
        """End background publishing (if started), then publish what is left on the calling thread."""
        halt, self._halt = self._halt, None
        if halt is not None:
            halt()
            self.publish()

    @property
    def running(self) -> bool:
        """Whether :meth:`start` is in effect."""
        return self._halt is not None

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _round(self) -> None:
        try:
            self.publish()
        except Exception:
            self.errors += 1
            _log.exception("KV event publisher %r: a background round failed", self.producer)

    def _run(self, stop: threading.Event, interval_s: float) -> None:
        while not stop.wait(interval_s):
            self._round()


# ---------------------------------------------------------------------- consumer


class EventConsumer:
    """Applies batches of many producers in order; detects gaps; waits for snapshots after one.

    Per producer, :meth:`feed` applies batch ``last + 1`` by calling ``on_events``.
    The first batch of a producer it has not seen is expected to be batch 0 (the
    start of its stream) or a snapshot -- a consumer that joins late therefore asks
    for a resync instead of holding a partial view. Any other number is a gap:
    ``on_gap(producer, expected, got)`` is called once, the producer enters
    :attr:`needs_resync` and its batches are ignored (counted in ``skipped``) until a
    snapshot batch arrives, which ``on_snapshot`` applies as a replacement; numbering
    continues from it. A snapshot is accepted at any number above the last applied.
    Batches numbered at or below the last applied are duplicates (ignored, counted) --
    except batch 0, which means the producer restarted: a snapshot 0 is applied, a
    plain batch 0 is a gap (counted in ``restarts`` too).

    The consumer does not ask producers for a resync itself: ``on_gap`` and
    :attr:`needs_resync` tell the application, which asks (or producers snapshot
    periodically). If ``on_events`` / ``on_snapshot`` raises, the producer enters
    :attr:`needs_resync` (its view may be half-applied) and the exception propagates.
    """

    __slots__ = (
        "_last",
        "_resync",
        "_time",
        "batches",
        "duplicates",
        "feed_errors",
        "gaps",
        "malformed",
        "on_events",
        "on_gap",
        "on_snapshot",
        "restarts",
        "skipped",
    )

    def __init__(
        self,
        *,
        on_events: Callable[[str, tuple[KVEvent, ...]], None],
        on_snapshot: Callable[[str, tuple[KVEvent, ...]], None],
        on_gap: Callable[[str, int, int], None] | None = None,
    ) -> None:
        self.on_events = on_events
        self.on_snapshot = on_snapshot
        self.on_gap = on_gap
        self._last: dict[str, int] = {}
        self._time: dict[str, float] = {}
        self._resync: set[str] = set()
        self.batches = 0
        """Batches applied (snapshots included)."""
        self.gaps = 0
        self.duplicates = 0
        self.skipped = 0
        """Batches ignored while their producer waited for a snapshot."""
        self.restarts = 0
        self.malformed = 0
        """Payloads that did not decode (counted by :func:`kvblocks.event_transport.pump`)."""
        self.feed_errors = 0
        """Batches whose callback raised inside :func:`kvblocks.event_transport.pump` (which logs and goes on)."""

    @property
    def needs_resync(self) -> set[str]:
        """Producers whose view is stale until their next snapshot (a copy)."""
        return set(self._resync)

    @property
    def producers(self) -> list[str]:
        """Producers with at least one applied batch, in first-seen order."""
        return list(self._last)

    def last_seq(self, producer: str) -> int | None:
        """Number of the producer's last applied batch (None: nothing applied yet)."""
        return self._last.get(producer)

    def last_event_time(self, producer: str) -> float | None:
        """``time.monotonic()`` when the producer's last batch was applied (None: never)."""
        return self._time.get(producer)

    def forget(self, producer: str) -> None:
        """Drop all state of ``producer`` (a node that left): its next batch is treated as its first."""
        self._last.pop(producer, None)
        self._time.pop(producer, None)
        self._resync.discard(producer)

    def feed(self, batch: EventBatch) -> bool:
        """Apply ``batch`` if it is the producer's next one (or a usable snapshot); return whether it was applied."""
        producer, seq = batch.producer, batch.seq
        last = self._last.get(producer)
        restart = last is not None and seq == 0
        if last is not None and seq <= last and not restart:
            self.duplicates += 1
            return False
        if batch.snapshot:
            if restart:
                self.restarts += 1
            self._resync.discard(producer)
            self._apply(producer, batch, self.on_snapshot)
            return True
        if producer in self._resync:
            self.skipped += 1
            return False
        expected = 0 if last is None else last + 1
        if restart or seq != expected:
            if restart:
                self.restarts += 1
            self.gaps += 1
            self._resync.add(producer)
            if self.on_gap is not None:
                self.on_gap(producer, expected, seq)
            return False
        self._apply(producer, batch, self.on_events)
        return True

    def _apply(self, producer: str, batch: EventBatch, callback: Callable[[str, tuple[KVEvent, ...]], None]) -> None:
        self._last[producer] = batch.seq
        self._time[producer] = time.monotonic()
        self.batches += 1
        try:
            callback(producer, batch.events)
        except BaseException:
            self._resync.add(producer)
            raise
