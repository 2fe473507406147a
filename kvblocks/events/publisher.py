"""The sending end of KV events across processes: an :class:`EventPublisher` drains an
:class:`~kvblocks.events.sink.EventSink` and sends its records as numbered batches through a transport
(:mod:`kvblocks.events.transport`, or one with a wire format of its own: :mod:`kvblocks.interop`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvblocks.errors import ConfigError
from kvblocks.events.codec import EventBatch, KVEvent, build_pending, encode_batch
from kvblocks.events.sink import EventSink

if TYPE_CHECKING:  # the transport layer is below this one (and never imports it)
    from kvblocks.events.transport import EventTransport

__all__ = ["EventPublisher"]

_log = logging.getLogger("kvblocks.events")


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
        events unbuilt (:data:`~kvblocks.events.codec.PendingEvent` entries) and builds them one at a time
        as it encodes them (:func:`~kvblocks.events.codec.build_pending`), so they never all live at once.
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
