"""The receiving end of KV events: an :class:`EventConsumer` applies the batches of many producers in order,
detects gaps and waits for a snapshot after one (fed by :func:`kvblocks.events.transport.pump`, or by
:func:`kvblocks.interop.zmq_events.pump_subscriber`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvblocks.events.codec import EventBatch, KVEvent

__all__ = ["EventConsumer"]


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
        """Payloads that did not decode (counted by :func:`kvblocks.events.transport.pump`)."""
        self.feed_errors = 0
        """Batches whose callback raised inside :func:`kvblocks.events.transport.pump` (which logs and goes on)."""

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
