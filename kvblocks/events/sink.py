"""The in-process end of KV events: an :class:`EventSink` numbers a cache's events and delivers them to
subscribers and to a bounded buffer that a publisher drains (see :mod:`kvblocks.events`)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvblocks.errors import ConfigError
from kvblocks.events.codec import (
    NO_ARG,
    KVEvent,
    PendingEvent,
    build_pending,
    pending_args,
    removed_event,
    stored_event,
)
from kvblocks.hashing import BlockHash

__all__ = ["EventRecord", "EventSink", "record_changes"]

_log = logging.getLogger("kvblocks.events")


@dataclass(slots=True, unsafe_hash=True)  # a value, never modified; not frozen: see kvblocks.events.codec.KVEvent
class EventRecord:
    """An event with its sequence number (0, 1, 2, ... per sink) and wall-clock timestamp."""

    seq: int
    timestamp: float
    event: KVEvent


class EventSink:
    """Numbers events and delivers them in process.

    >>> from kvblocks.events import AllBlocksCleared
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
