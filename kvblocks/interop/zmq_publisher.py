"""Publish a kvblocks manager's KV events over ZMQ in vLLM's (or SGLang's) wire format: :class:`ZmqEventPublisher`,
a transport of :class:`~kvblocks.events.EventPublisher`, with the replay socket behind it. The wire and the whole
story are told in :mod:`kvblocks.interop.zmq_events`; this module also holds what both ends of the wire share
(the frames, :func:`require_zmq`, the settings' checks).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvblocks.errors import ConfigError, EventDecodeError, MissingExtraError
from kvblocks.events.codec import EventBatch, PendingEvent, decode_batch
from kvblocks.interop.engine_wire import Dialect, _check_dialect, encode_engine_events, require_msgspec
from kvblocks.interop.fast_wire import encode_pending_events

__all__ = ["END_SEQ", "ZmqEventPublisher", "require_zmq"]

_log = logging.getLogger("kvblocks.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame of the replay socket's end marker."""

_IDLE_WAIT_S = 0.005  # the publisher thread's longest wait: how late an idle publisher answers a replay request


def require_zmq() -> Any:
    """Import pyzmq (and msgspec), or raise :class:`ConfigError` naming the extra that installs them."""
    require_msgspec()
    try:
        import zmq
    except ImportError:
        raise MissingExtraError("KV events over ZMQ need pyzmq", "zmq") from None
    return zmq


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _positive(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _text(name: str, value: object) -> str:
    if type(value) is not str:
        raise ConfigError(f"{name} must be a str, got {value!r}")
    return value


def _seconds(name: str, value: object) -> float:
    """A finite duration > 0 from the configuration, as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int beyond a float's range
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}") from None


class ZmqEventPublisher:
    """A kvblocks event transport that speaks vLLM's (or SGLang's) ZMQ wire; see the module docstring.

    ``endpoint`` / ``replay_endpoint`` are bound (``tcp://*:5557``, ``tcp://127.0.0.1:0`` for a free port:
    :attr:`endpoint` then names the port taken). ``dialect``, ``int_hashes`` and ``dp_rank`` choose the
    payload (:func:`~kvblocks.interop.engine_wire.encode_engine_batch`). ``max_queue`` bounds the batches
    waiting for the background thread; ``buffer_steps`` the batches kept for replay.

    Counters (updated by the background thread): ``sent``, ``dropped`` (queue full or closed), ``errors``
    (a batch that did not encode or send, or a malformed replay request), ``replays`` (requests answered).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        dialect: Dialect = "vllm",
        int_hashes: bool = True,
        dp_rank: int | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue: int = 100_000,
        context: Any = None,
    ) -> None:
        zmq = require_zmq()
        self.dialect = _check_dialect(dialect)
        self.topic = _text("topic", topic)
        self.buffer_steps = _positive("buffer_steps", buffer_steps)
        self.max_queue = _positive("max_queue", max_queue)
        _positive("hwm", hwm)
        if dp_rank is not None and (type(dp_rank) is not int or dp_rank < 0):
            raise ConfigError(f"dp_rank must be None or an int >= 0, got {dp_rank!r}")
        self.int_hashes = bool(int_hashes)
        self.dp_rank = dp_rank
        self._zmq = zmq
        self._ctx = context if context is not None else zmq.Context.instance()
        self._topic = self.topic.encode()
        self._pub = self._bind(zmq.PUB, endpoint, hwm)
        self._replay = None
        try:
            if replay_endpoint is not None:
                # Room for a whole replay and its end marker (ZMQ counts the high-water mark in messages).
                self._replay = self._bind(zmq.ROUTER, replay_endpoint, 2 * (self.buffer_steps + 1))
        except BaseException:
            self._pub.close(linger=0)
            raise
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self._queue: deque[EventBatch | tuple[int, float, list[PendingEvent]]] = deque()
        self._rounds: list[Callable[[], object]] = []  # run_periodically's callables
        self._wait_s = _IDLE_WAIT_S
        self._ready = threading.Condition()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)
        self._closed = False
        self.sent = 0
        self.dropped = 0
        self.errors = 0
        self.replays = 0
        self._thread = threading.Thread(target=self._run, name="kvblocks-zmq-events", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, endpoint: str, hwm: int) -> Any:
        sock = self._ctx.socket(kind)
        try:
            sock.setsockopt(self._zmq.SNDHWM, hwm)
            sock.setsockopt(self._zmq.LINGER, 0)
            sock.bind(endpoint)
        except Exception as error:
            sock.close(linger=0)
            raise ConfigError(f"cannot bind a KV event socket to {endpoint!r}: {error}") from None
        return sock

    # -- the engine's side: never blocks on the network, never raises

    def send_batch(self, batch: EventBatch) -> None:
        """Queue ``batch`` for sending (wire seq = ``batch.seq``); drop and count it when the queue is full.

        No lock and no wake-up: a deque's append is atomic, and the publisher thread looks at the queue
        every few milliseconds (``_IDLE_WAIT_S``) anyway. Waking it per batch cost the engine thread a
        third of the events' whole cost (a context switch and a GIL hand-over per engine step).
        """
        if self._closed or len(self._queue) >= self.max_queue:
            self.dropped += 1
            return
        self._queue.append(batch)

    def send_pending(self, producer: str, seq: int, timestamp: float, entries: list[PendingEvent]) -> None:
        """:meth:`send_batch` of events not built yet (:meth:`kvblocks.events.EventPublisher.publish`): the
        publisher thread encodes them without building them (:mod:`kvblocks.interop.fast_wire`)."""
        if self._closed or len(self._queue) >= self.max_queue:
            self.dropped += 1
            return
        self._queue.append((seq, timestamp, entries))

    def run_periodically(self, round_fn: Callable[[], object], interval_s: float) -> Callable[[], None]:
        """Call ``round_fn`` on the publisher thread every ``interval_s`` (at most), before it sends what is
        queued; return a function that stops the calls (after it returns, ``round_fn`` is not running and
        will not run again). :meth:`kvblocks.events.EventPublisher.start` uses it, so that publishing in the
        background takes this one thread, not two: each thread that wakes takes the GIL from the engine."""
        with self._ready:
            if self._closed:
                raise ConfigError("the ZMQ event publisher is closed")
            self._rounds.append(round_fn)
            self._wait_s = min(self._wait_s, float(interval_s))
            self._ready.notify_all()

        def stop() -> None:
            with self._ready:
                if round_fn in self._rounds:
                    self._rounds.remove(round_fn)
                while self._in_round is round_fn and threading.current_thread() is not self._thread:
                    self._ready.wait(_IDLE_WAIT_S)

        return stop

    def send(self, data: bytes) -> None:
        """A kvblocks JSON payload (:func:`~kvblocks.events.codec.encode_batch`): re-sent in the engine wire."""
        try:
            batch = decode_batch(data)
        except EventDecodeError:
            self.errors += 1
            return
        self.send_batch(batch)

    def receive(self, max_count: int = 100, timeout_s: float = 0.0) -> list[bytes]:
        """A publisher receives nothing (part of :class:`~kvblocks.events.transport.EventTransport`)."""
        return []

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued batch has been sent (or ``timeout_s``); return whether the queue emptied."""
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._ready.wait(min(remaining, _IDLE_WAIT_S))
        return True

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout_s``), stop the thread and close the sockets."""
        if self._thread.is_alive():
            self.flush(timeout_s)
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        self._thread.join(timeout_s)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the background thread: owns both sockets

    _busy = False
    _in_round: Callable[[], object] | None = None

    def _run(self) -> None:
        queue = self._queue
        try:
            while True:
                with self._ready:
                    if not queue and not self._closed:
                        self._ready.wait(self._wait_s)
                    if self._closed and not queue:
                        break
                    rounds = list(self._rounds)
                for round_fn in rounds:
                    with self._ready:
                        if round_fn not in self._rounds:
                            continue  # stopped meanwhile
                        self._in_round = round_fn
                    try:
                        round_fn()
                    except Exception:
                        self.errors += 1
                        _log.exception("ZMQ KV event publisher: a periodic round failed")
                    finally:
                        with self._ready:
                            self._in_round = None
                            self._ready.notify_all()
                with self._ready:
                    self._busy = bool(queue)
                while queue:  # popleft, not list + clear: the engine thread appends without the lock
                    self._publish(queue.popleft())
                with self._ready:
                    self._busy = False
                    self._ready.notify_all()
                self._serve_replays()
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _publish(self, item: EventBatch | tuple[int, float, list[PendingEvent]]) -> None:
        try:
            if isinstance(item, EventBatch):
                seq = item.seq
                payload = encode_engine_events(
                    item.events,
                    item.timestamp,
                    self.dialect,
                    int_hashes=self.int_hashes,
                    dp_rank=self.dp_rank,
                    snapshot=item.snapshot,
                )
            else:  # from send_pending: written straight from the sink's entries, no event built
                seq, ts, entries = item
                payload = encode_pending_events(
                    entries, ts, self.dialect, int_hashes=self.int_hashes, dp_rank=self.dp_rank
                )
            self._pub.send_multipart((self._topic, _seq_bytes(seq), payload))
        except Exception:
            self.errors += 1
            _log.exception("ZMQ KV event publisher: batch %d was not sent", seq)
            return
        self._buffer.append((seq, payload))
        self.sent += 1

    def _serve_replays(self) -> None:
        replay = self._replay
        if replay is None:
            return
        zmq = self._zmq
        while replay.poll(0):
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 3 or len(frames[2]) != 8:
                    self.errors += 1  # not a replay request; vLLM logs and ignores these too
                    continue
                client, start = frames[0], int.from_bytes(frames[2], "big")
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        replay.send_multipart((client, b"", self._topic, _seq_bytes(seq), payload))
                replay.send_multipart((client, b"", b"", END_SEQ, b""))
                self.replays += 1
            except zmq.ZMQError:
                self.errors += 1
                _log.exception("ZMQ KV event publisher: a replay request failed")
                return


# ---------------------------------------------------------------------- subscriber
