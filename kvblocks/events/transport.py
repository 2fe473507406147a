"""Transports for KV event batches: in process, or through a Redis stream shared by many nodes.

A transport moves opaque payloads (:func:`kvblocks.events.encode_batch` bytes) in
order. Loss is allowed -- a full queue, a server that is down -- because consumers
detect it from the batch numbers and ask for a resync; raising into the engine's
step is not. :func:`pump` moves everything available into an
:class:`kvblocks.events.EventConsumer`::

    worker:  EventPublisher("worker-3", sink, RedisStreamTransport(url), snapshot=tree.snapshot_events)
    router:  transport = RedisStreamTransport(url)          # its own reader position
             pump(transport, consumer, timeout_s=0.1)       # in its loop

* :class:`InProcessTransport` -- a bounded, thread-safe queue for one node and tests.
  Each payload goes to one receiver: use one transport per consumer.
* :class:`RedisStreamTransport` -- ``XADD`` to one stream (approximately capped at
  ``maxlen`` entries) and ``XREAD`` from it. Every instance keeps its own reader
  position, so any number of routers follow the same stream; a reader that falls
  further behind than ``maxlen`` loses entries, which shows as a gap. Failures are
  counted in ``errors``, never raised: ``send`` drops, ``receive`` returns nothing,
  and the next call tries again, so the stream resumes by itself when the server is back.
  It needs the ``redis`` package, imported when a transport is created.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from typing import Any, Protocol, runtime_checkable

from kvblocks.errors import ConfigError, InvalidArgumentError
from kvblocks.events.codec import EventBatch, decode_batch
from kvblocks.redis_client import connect

__all__ = ["BatchConsumer", "EventTransport", "InProcessTransport", "RedisStreamTransport", "pump"]

_log = logging.getLogger("kvblocks.events")


@runtime_checkable
class EventTransport(Protocol):
    """Moves payloads in order; may lose some, never raises for a delivery failure."""

    def send(self, data: bytes) -> None:
        """Hand one payload over (or drop and count it)."""
        ...

    def receive(self, max_count: int = 100, timeout_s: float = 0.0) -> list[bytes]:
        """Up to ``max_count`` payloads, oldest first; waits up to ``timeout_s`` for the first one."""
        ...

    def close(self) -> None: ...


class BatchConsumer(Protocol):
    """What :func:`pump` feeds: :class:`kvblocks.events.EventConsumer` (named here by shape only,
    so that this layer does not import the one above it)."""

    malformed: int
    feed_errors: int

    def feed(self, batch: EventBatch) -> bool: ...


def receive_timeout(timeout_s: object) -> float:
    """A ``receive``'s ``timeout_s`` as a float: any number >= 0, ``math.inf`` (or an int past a float's range)
    for no limit; anything else raises :class:`InvalidArgumentError`."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s >= 0:
        raise InvalidArgumentError(f"timeout_s must be a number >= 0, got {timeout_s!r}")
    try:
        return float(timeout_s)
    except OverflowError:
        return math.inf


def _check_receive_args(max_count: int, timeout_s: object) -> float:
    if type(max_count) is not int or max_count < 1:
        raise InvalidArgumentError(f"max_count must be an int >= 1, got {max_count!r}")
    return receive_timeout(timeout_s)


class InProcessTransport:
    """A bounded FIFO queue of payloads, safe to use from several threads.

    When ``capacity`` payloads are waiting, sending drops the oldest (counted in
    ``dropped``; consumers see a gap). One queue: every payload is received once,
    by whichever receiver takes it first. After :meth:`close`, sends are dropped and
    receives return what is left without waiting.

    >>> t = InProcessTransport(capacity=2)
    >>> for p in (b"a", b"b", b"c"):
    ...     t.send(p)
    >>> t.receive(), t.dropped
    ([b'b', b'c'], 1)
    """

    def __init__(self, capacity: int = 65536) -> None:
        if type(capacity) is not int or capacity < 1:
            raise ConfigError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._queue: deque[bytes] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self.sent = 0
        self.received = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._queue)

    def send(self, data: bytes) -> None:
        with self._ready:
            if self._closed:
                self.dropped += 1
                return
            if len(self._queue) >= self.capacity:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(bytes(data))
            self.sent += 1
            self._ready.notify()

    def receive(self, max_count: int = 100, timeout_s: float = 0.0) -> list[bytes]:
        wait = _check_receive_args(max_count, timeout_s)
        queue = self._queue
        with self._ready:
            if not queue and wait > 0 and not self._closed:
                self._ready.wait_for(lambda: bool(queue) or self._closed, None if wait == math.inf else wait)
            out = [queue.popleft() for _ in range(min(max_count, len(queue)))]
            self.received += len(out)
            return out

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()


_FIELD = b"d"  # the stream entry field holding the payload
_BLOCK_SLACK_S = 0.25  # a server answers a timed-out XREAD BLOCK up to 1/hz late (100 ms by default)
_POLL_S = 0.02  # the polling interval of a wait when the socket timeout is too short to block in
_IDLE_RETRY_S = 1.0  # the longest a receive sleeps on a server it cannot use before returning empty


class RedisStreamTransport:
    """Payloads as entries of one Redis stream (see the module docstring).

    ``start`` is where this instance begins reading: ``"$"`` (default) -- entries
    added after it was created (resolved at the first contact with the server); ``"0"``
    -- everything still in the stream; or an explicit entry id such as ``"1700000000000-0"``.
    ``socket_timeout`` bounds every call; a :meth:`receive` with a timeout waits in
    ``XREAD BLOCK`` slices at least 0.25 s shorter than it (the server may answer a
    block that expired up to 100 ms late), or polls every 20 ms when the socket timeout
    is shorter than that. Counters: ``sent``, ``received``, ``errors``.
    """

    def __init__(
        self,
        url: str,
        stream: str = "kvblocks:events",
        *,
        maxlen: int = 100_000,
        socket_timeout: float = 1.0,
        start: str = "$",
    ) -> None:
        if type(stream) is not str or not stream:
            raise ConfigError(f"stream must be a non-empty str, got {stream!r}")
        if type(maxlen) is not int or maxlen < 1:
            raise ConfigError(f"maxlen must be an int >= 1, got {maxlen!r}")
        if isinstance(socket_timeout, bool) or not socket_timeout > 0:
            raise ConfigError(f"socket_timeout must be > 0, got {socket_timeout!r}")
        if type(start) is not str or not (start == "$" or _is_stream_id(start)):
            raise ConfigError(f'start must be "$", "0" or a stream entry id, got {start!r}')
        self._client: Any
        self._client, self._errors = connect(url, socket_timeout, user="RedisStreamTransport")
        self.url = url
        self.stream = stream
        self.maxlen = maxlen
        self.socket_timeout = float(socket_timeout)
        self._last_id: str | None = None if start == "$" else start
        self.sent = 0
        self.received = 0
        self.errors = 0
        """Calls that failed (server down, timeout, refused command); each was dropped or returned nothing."""
        if self._last_id is None:
            self._resolve_start()

    @property
    def last_id(self) -> str | None:
        """Id of the last entry read (None: ``"$"`` not yet resolved)."""
        return self._last_id

    def _resolve_start(self) -> bool:
        """Pin ``"$"`` to the stream's newest entry now, so entries added later are read."""
        try:
            newest = self._client.xrevrange(self.stream, count=1)
        except self._errors:
            self.errors += 1
            return False
        self._last_id = _text(newest[0][0]) if newest else "0-0"
        return True

    def send(self, data: bytes) -> None:
        try:
            self._client.xadd(self.stream, {_FIELD: bytes(data)}, maxlen=self.maxlen, approximate=True)
        except self._errors:
            self.errors += 1
            return
        self.sent += 1

    def receive(self, max_count: int = 100, timeout_s: float = 0.0) -> list[bytes]:
        deadline = time.monotonic() + _check_receive_args(max_count, timeout_s)
        if self._last_id is None and not self._resolve_start():
            self._wait_until(deadline)
            return []
        while True:
            # Wait inside the server (XREAD BLOCK) in slices the socket timeout leaves room for; poll
            # when it leaves none. Never BLOCK 0: that waits forever.
            remaining = deadline - time.monotonic()
            slice_s = min(remaining, self.socket_timeout - _BLOCK_SLACK_S)
            block = int(slice_s * 1000) if slice_s >= 0.01 else None
            try:
                reply = self._client.xread({self.stream: self._last_id}, count=max_count, block=block)
            except self._errors:
                self.errors += 1
                self._wait_until(deadline)  # no busy loop against a server that is down
                return []
            entries = _entries(reply)
            remaining = deadline - time.monotonic()
            if entries or remaining <= 0:
                break
            if block is None:
                time.sleep(min(_POLL_S, remaining))
        out: list[bytes] = []
        for entry_id, fields in entries:
            self._last_id = _text(entry_id)
            value = fields.get(_FIELD, fields.get(_FIELD.decode()))
            out.append(value if isinstance(value, bytes) else b"")  # a foreign entry: pump counts it malformed
        self.received += len(out)
        return out

    @staticmethod
    def _wait_until(deadline: float) -> None:
        """Sleep until ``deadline``, or for :data:`_IDLE_RETRY_S` at most: a receive without a limit that meets a
        server it cannot use returns empty rather than never (its caller asks again)."""
        remaining = deadline - time.monotonic()
        if remaining > 0:
            time.sleep(min(remaining, _IDLE_RETRY_S))

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self._client.close()


def _is_stream_id(value: str) -> bool:
    ms, _, seq = value.partition("-")
    return ms.isascii() and ms.isdigit() and (not seq or (seq.isascii() and seq.isdigit()))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entries(reply: Any) -> list[tuple[Any, dict[Any, Any]]]:
    """The entries of one stream from an XREAD reply (RESP2: a list of pairs; RESP3: a dict)."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else [pair[1] for pair in reply]
    out: list[tuple[Any, dict[Any, Any]]] = []
    for entries in streams:
        for entry in entries:
            # A stream's entries are [id, fields]; an entry deleted from a pending list has fields None.
            out.append((entry[0], entry[1] or {}))
    return out


def pump(transport: EventTransport, consumer: BatchConsumer, *, max_count: int = 100, timeout_s: float = 0.0) -> int:
    """Receive, decode and feed every payload available; return how many batches were fed.

    Waits up to ``timeout_s`` for the first payload only, then reads until the
    transport returns fewer than ``max_count`` (caught up). No payload stops the loop
    or costs the payloads received with it: one that does not decode is logged,
    counted in ``consumer.malformed`` and skipped (the batch it was leaves a gap,
    which the consumer reports); one whose feeding raises (a callback of the
    consumer failed; the consumer marks its producer for a resync) is logged with
    its traceback and counted in ``consumer.feed_errors``. ``KeyboardInterrupt`` and
    ``SystemExit`` still propagate.
    """
    fed = 0
    wait = timeout_s
    while True:
        payloads = transport.receive(max_count, wait)
        wait = 0.0
        for data in payloads:
            fed += _feed_one(consumer, data)
        if len(payloads) < max_count:
            return fed


def _feed_one(consumer: BatchConsumer, data: bytes) -> int:
    """Decode and feed one payload; 1 if it was fed, 0 if it was skipped (and counted)."""
    try:
        batch = decode_batch(data)
    except Exception as error:  # EventDecodeError by contract; anything else is counted the same way
        consumer.malformed += 1
        _log.warning("skipping a malformed KV event payload: %s", error)
        return 0
    try:
        consumer.feed(batch)
    except Exception:
        consumer.feed_errors += 1
        _log.exception("feeding KV event batch %d of %r failed; it awaits a resync", batch.seq, batch.producer)
        return 0
    return 1
