"""KV events: what a cache tier stored, removed or cleared, numbered in emission order.

A :class:`kvblocks.radix.PrefixTree` emits one event per batch it changes (one
``BlockStored`` per insert call, one ``BlockRemoved`` per eviction call), carrying
block hashes -- the same keys a router or indexer uses. An :class:`EventSink`
numbers them 0, 1, 2, ... and delivers them in process: to subscribers as they
happen and to a bounded buffer for polling. A consumer that sees a gap in the
numbers knows it missed events and must resynchronise.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvblocks.errors import ConfigError
from kvblocks.hashing import BlockHash

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventRecord", "EventSink", "KVEvent"]

_log = logging.getLogger("kvblocks.events")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks became findable in ``tier``; ``block_hashes`` form a chain hanging off ``parent_hash``."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    tier: str


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks are no longer findable in ``tier``."""

    block_hashes: tuple[BlockHash, ...]
    tier: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of ``tier`` was dropped."""

    tier: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
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
    """

    __slots__ = ("_buffer", "_clock", "_next_seq", "_subscribers", "subscriber_errors")

    def __init__(self, capacity: int = 65536, *, clock: Callable[[], float] = time.time) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"event buffer capacity must be an int >= 0, got {capacity!r}")
        self._next_seq = 0
        self._buffer: deque[EventRecord] = deque(maxlen=capacity)
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
        record = EventRecord(self._next_seq, self._clock(), event)
        self._next_seq += 1
        self._buffer.append(record)
        for callback in self._subscribers:
            try:
                callback(record)
            except Exception:
                self.subscriber_errors += 1
                _log.exception("KV event subscriber %r failed on event %d", callback, record.seq)
        return record

    def drain(self) -> list[EventRecord]:
        """Return and forget the buffered records, oldest first."""
        out = list(self._buffer)
        self._buffer.clear()
        return out
