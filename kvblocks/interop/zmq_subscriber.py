"""KV events over ZMQ in vLLM's wire format, both ways: publish a kvblocks manager's events to vLLM consumers
(llm-d's indexer, Dynamo's router), and feed a vLLM or SGLang engine's events to a kvblocks :class:`Router`.

The wire, as vLLM's and SGLang's ``ZmqEventPublisher`` speak it:

* a PUB socket sends one multipart message per batch: ``(topic, seq as 8 bytes big-endian, payload)``, the
  payload a msgpack ``KVEventBatch`` (:mod:`kvblocks.interop.engine_wire`);
* a ROUTER socket answers a replay request ``(identity, b"", start_seq as 8 bytes big-endian)`` with
  ``(identity, b"", topic, seq, payload)`` for every buffered batch numbered ``>= start_seq``, then the end
  marker ``(identity, b"", b"", -1 as 8 signed bytes, b"")``. (vLLM <= 0.11 left the topic frame out; the
  subscriber reads both.)

Publishing::

    pub = ZmqEventPublisher("tcp://*:5557", "tcp://*:5558", topic="kv@worker-3")
    publisher = EventPublisher("worker-3", manager.events, pub, snapshot=manager.snapshot_events)
    publisher.publish()  # each engine step: batches leave with their kvblocks seq as the wire seq

:class:`ZmqEventPublisher` has ``send_batch``, so :class:`~kvblocks.events.EventPublisher` hands it the numbered
:class:`EventBatch`; the wire seq is the batch's seq, so a batch the publisher skipped is a gap on the wire too.
The engine thread only appends the batch to a bounded queue; a background thread owns both sockets, encodes,
sends, keeps the last ``buffer_steps`` payloads and answers replay requests (every 5 ms at most while idle).
With ``publisher.start()`` that thread also runs the publisher's rounds (:meth:`ZmqEventPublisher.run_periodically`):
the engine thread then only records its events; this thread takes them unbuilt (``send_pending``) and writes
the payload straight from the sink's entries (:func:`kvblocks.interop.fast_wire.encode_pending_events`: the
same bytes as :func:`~kvblocks.interop.engine_wire.encode_engine_events`, in less than half its CPU time,
which on a small machine is taken from the engine's thread).
Nothing raises into the engine: a full queue or a failed send is counted (``dropped``, ``errors``).

Consuming::

    sub = ZmqEventSubscriber("tcp://engine-3:5557", "tcp://engine-3:5558", worker="engine-3", dialect="vllm")
    consumer = EventConsumer(on_events=router.apply_events, on_snapshot=router.replace_index)
    pump_subscriber(sub, consumer, timeout_s=0.1)  # in the router's loop

:meth:`ZmqEventSubscriber.receive` returns kvblocks batches numbered with the wire seq. On a gap (a seq that is
not the last + 1, or a first message that is not seq 0: a late joiner) it asks the replay socket for the
missing batches and delivers them in order, dropping the ones it already had. A subscriber that has nothing
yet and finds no live message waiting asks for everything from seq 0 at once (the *join*): a router that
joins an idle engine learns what the engine still buffers without waiting for its next batch; an engine
that never published answers with the end marker alone, and the subscriber waits for seq 0 live. When the
replay cannot fill the gap (the engine's buffer no longer reaches back, no replay socket, no answer in
``replay_timeout_s``), it delivers the first batch it does have as a *snapshot*: the router forgets what it
knew of that worker and starts again from there -- it promises less than the worker holds, never more. A
payload that does not decode is counted and handled the same way; an engine that restarts (seq 0 again)
resets the worker too.

The router's loop is never held up for long: one ``receive`` waits at most its ``timeout_s`` plus one
replay (``replay_timeout_s``); a second gap in the same call waits for the next call. A replay socket that
does not answer is not asked again for ``replay_backoff_s``, doubling at each further silence up to
``replay_backoff_max_s``; meanwhile a gap resets the worker at once, without waiting.

Both classes need ``pyzmq`` and ``msgspec`` (``pip install "kvblocks[zmq]"``), imported when one is created.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvblocks.errors import ConfigError, EventDecodeError, InvalidArgumentError, MissingExtraError
from kvblocks.event_codec import EventBatch, PendingEvent, decode_batch
from kvblocks.event_transport import BatchConsumer, receive_timeout
from kvblocks.interop.engine_wire import (
    Dialect,
    EngineEventDecoder,
    _check_dialect,
    encode_engine_events,
    require_msgspec,
)
from kvblocks.interop.fast_wire import encode_pending_events

__all__ = ["ZmqEventPublisher", "ZmqEventSubscriber", "pump_subscriber", "require_zmq"]

_log = logging.getLogger("kvblocks.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame of the replay socket's end marker."""

_IDLE_WAIT_S = 0.005  # the publisher thread's longest wait: how late an idle publisher answers a replay request
_MAX_POLL_S = 1.0  # the longest single wait of a subscriber's poll (a longer wait is taken in slices)


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


# ---------------------------------------------------------------------- publisher


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
        """A kvblocks JSON payload (:func:`~kvblocks.event_codec.encode_batch`): re-sent in the engine wire."""
        try:
            batch = decode_batch(data)
        except EventDecodeError:
            self.errors += 1
            return
        self.send_batch(batch)

    def receive(self, max_count: int = 100, timeout_s: float = 0.0) -> list[bytes]:
        """A publisher receives nothing (part of :class:`~kvblocks.event_transport.EventTransport`)."""
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


class ZmqEventSubscriber:
    """Reads one engine's ZMQ KV event stream as kvblocks :class:`EventBatch` es of producer ``worker``.

    Connects a SUB socket to ``endpoint`` (only messages whose topic is exactly ``topic``, any when it is
    empty) and a DEALER to the engine's ``replay_endpoint``. With ``bind=True`` the SUB socket binds
    ``endpoint`` instead: a vLLM engine whose ``kv_events_config.endpoint`` has no ``*`` (say
    ``tcp://127.0.0.1:5557``) connects its PUB socket to it, so the consumer must be the side that binds
    (bind before the engine starts; ``self.endpoint`` is the address bound, its port resolved).

    See the module docstring for the join, gaps, replays, resets and the back-off of a silent replay socket
    (``replay_timeout_s``: the longest one replay waits for its end marker; ``replay_backoff_s`` /
    ``replay_backoff_max_s``: the first and the longest pause after a replay that was not answered).
    Counters: ``received`` (live messages), ``gaps``, ``replays`` (requests sent), ``replayed`` (batches
    recovered through them), ``replay_failures`` (requests not answered in time), ``resets`` (snapshots
    standing in for what could not be recovered), ``restarts``, ``duplicates``, ``malformed`` (messages or
    payloads that did not decode).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        worker: str,
        topic: str = "",
        dialect: Dialect = "vllm",
        replay_timeout_s: float = 1.0,
        replay_backoff_s: float = 1.0,
        replay_backoff_max_s: float = 30.0,
        context: Any = None,
        bind: bool = False,
    ) -> None:
        zmq = require_zmq()
        if not isinstance(bind, bool):
            raise ConfigError(f"bind must be a bool, got {bind!r}")
        if type(worker) is not str or not worker:
            raise ConfigError(f"worker must be a non-empty str, got {worker!r}")
        self.worker = worker
        self.topic = _text("topic", topic)
        self.dialect = _check_dialect(dialect)
        self.replay_timeout_s = _seconds("replay_timeout_s", replay_timeout_s)
        self.replay_backoff_s = _seconds("replay_backoff_s", replay_backoff_s)
        self.replay_backoff_max_s = _seconds("replay_backoff_max_s", replay_backoff_max_s)
        if self.replay_backoff_max_s < self.replay_backoff_s:
            raise ConfigError(
                f"replay_backoff_max_s ({replay_backoff_max_s!r}) must be >= replay_backoff_s ({replay_backoff_s!r})"
            )
        self._zmq = zmq
        self._ctx = context if context is not None else zmq.Context.instance()
        self._topic = self.topic.encode()
        self._decoder = EngineEventDecoder(self.dialect)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._dealer = None
        self.endpoint = endpoint
        try:
            if bind:
                self._sub.bind(endpoint)
                self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._sub.connect(endpoint)
            if replay_endpoint is not None:
                self._dealer = self._ctx.socket(zmq.DEALER)
                self._dealer.setsockopt(zmq.LINGER, 0)
                # One request waits for an engine that is not there (yet), not one per retry: each would be
                # answered with the engine's whole buffer when it comes.
                self._dealer.setsockopt(zmq.SNDHWM, 1)
                self._dealer.connect(replay_endpoint)
        except zmq.ZMQError as error:
            self.close()
            raise ConfigError(
                f"cannot connect to the KV event endpoints {endpoint!r}, {replay_endpoint!r}: {error}"
            ) from None
        self._last: int | None = None
        self._reset_next = False
        self._joined = False  # the join's replay was answered: not asked again
        self._held: tuple[int, bytes] | None = None  # a gap left for the next receive (its replay)
        self._may_replay = True  # this receive has not replayed yet
        self._retry_at = 0.0  # monotonic time before which the replay socket is not asked (its back-off)
        self._backoff_s = self.replay_backoff_s  # the next back-off
        self.received = 0
        self.gaps = 0
        self.replays = 0
        self.replayed = 0
        self.replay_failures = 0
        self.resets = 0
        self.restarts = 0
        self.duplicates = 0
        self.malformed = 0

    @property
    def last_seq(self) -> int | None:
        """The wire seq of the last message taken (delivered or counted malformed)."""
        return self._last

    def receive(self, timeout_s: float = 0.0, max_count: int = 1000) -> list[EventBatch]:
        """The batches available, in order; waits up to ``timeout_s`` (``math.inf``: no limit) for the first
        live message when it has nothing to return, and spends at most one replay besides (see the module
        docstring). At most ``max_count`` live messages are taken.

        Raises :class:`InvalidArgumentError` for a ``max_count`` below 1 or a ``timeout_s`` that is not a
        number >= 0.
        """
        if type(max_count) is not int or max_count < 1:
            raise InvalidArgumentError(f"max_count must be an int >= 1, got {max_count!r}")
        deadline = time.monotonic() + receive_timeout(timeout_s)
        out: list[EventBatch] = []
        self._may_replay = True
        if not self._joined and self._last is None and self._held is None and not self._sub.poll(0):
            self._join(out)
        taken = 0
        held, self._held = self._held, None
        if held is not None:
            taken = 1
            if not self._take(held[0], held[1], out):
                return out
        if not out and taken == 0 and not self._wait(deadline):
            return out
        zmq = self._zmq
        while taken < max_count:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            taken += 1
            self.received += 1
            message = self._split(frames, live=True)
            if message is not None and not self._take(message[0], message[1], out):
                break
        return out

    def _wait(self, deadline: float) -> bool:
        """Wait for a live message until ``deadline`` (in slices: ZMQ takes a wait in whole milliseconds of a
        C int); return whether one is there."""
        while True:
            remaining = deadline - time.monotonic()
            if self._sub.poll(max(0, int(min(remaining, _MAX_POLL_S) * 1000))):
                return True
            if remaining <= _MAX_POLL_S:
                return False

    def _join(self, out: list[EventBatch]) -> None:
        """Ask for everything the engine still buffers: a late joiner of an idle engine learns it now."""
        replayed = self._replay_from(0)
        if replayed is None:
            return  # no replay socket, or it is silent: the live stream's gap asks again
        self._joined = True
        self._fill(0, replayed, out)  # empty: the engine never published; batch 0 comes live

    def _split(self, frames: list[bytes], *, live: bool) -> tuple[int, bytes] | None:
        """``(seq, payload)`` of a ``(topic, seq, payload)`` message (or ``(seq, payload)`` from old replays)."""
        if len(frames) == 3:
            topic, seq, payload = frames
            if self._topic and topic != self._topic:
                return None  # another stream's topic sharing the prefix: not ours
        elif len(frames) == 2 and not live:
            seq, payload = frames
        else:
            seq, payload = b"", b""
        if len(seq) != 8 or seq == END_SEQ:
            self.malformed += 1
            return None
        return int.from_bytes(seq, "big"), payload

    def _take(self, seq: int, payload: bytes, out: list[EventBatch]) -> bool:
        """Deliver live message ``seq`` (after recovering a gap before it); False: it waits for the next
        receive, which may replay (this one has replayed already)."""
        last = self._last
        if last is not None and seq == 0 and last > 0:
            self.restarts += 1  # the engine restarted: its cache is empty, its numbering starts over
            self._decoder = EngineEventDecoder(self.dialect)
            self._reset_next = True
        elif last is not None and seq <= last:
            self.duplicates += 1
            return True
        else:
            expected = 0 if last is None else last + 1
            if seq != expected:
                if not self._may_replay and self._can_replay():
                    self._held = (seq, payload)
                    return False
                self.gaps += 1
                replayed = self._replay_from(expected) or []
                if not replayed:
                    self._reset_next = True
                self._fill(expected, replayed, out)
                if self._last is not None and seq <= self._last:
                    return True  # the replay delivered it already
        self._deliver(seq, payload, out)
        return True

    def _deliver(self, seq: int, payload: bytes, out: list[EventBatch]) -> None:
        self._last = seq
        try:
            decoded = self._decoder.decode(payload)
        except EventDecodeError as error:
            self.malformed += 1
            self._reset_next = True  # what it held is lost: the next batch starts the worker's view again
            _log.warning("skipping a malformed KV event payload %d of %r: %s", seq, self.worker, error)
            return
        batch = decoded.as_event_batch(self.worker, seq)
        if self._reset_next and not batch.snapshot:
            batch = EventBatch(batch.producer, seq, batch.timestamp, batch.events, True)
            self.resets += 1
        self._reset_next = False
        out.append(batch)

    def _fill(self, expected: int, replayed: list[tuple[int, bytes]], out: list[EventBatch]) -> None:
        """Deliver the replayed batches from ``expected`` on; reset where they do not start there or have a hole."""
        if replayed and replayed[0][0] != expected:
            self._reset_next = True  # the engine's buffer no longer reaches back: start over from what comes
        for rseq, payload in replayed:
            if self._last is not None and rseq <= self._last:
                continue
            if self._last is not None and rseq != self._last + 1:
                self._reset_next = True  # a hole inside the replay
            self.replayed += 1
            self._deliver(rseq, payload, out)

    def _can_replay(self) -> bool:
        return self._dealer is not None and time.monotonic() >= self._retry_at

    def _replay_from(self, start: int) -> list[tuple[int, bytes]] | None:
        """Ask the replay socket for the batches from ``start``, in order; None when there is no socket, it is
        backing off, or it did not answer in ``replay_timeout_s`` (what came before the silence is kept)."""
        dealer = self._dealer
        if dealer is None or not self._can_replay():
            return None
        self._may_replay = False
        zmq = self._zmq
        with contextlib.suppress(zmq.Again):
            while True:  # a late answer to an earlier request that timed out
                dealer.recv_multipart(zmq.NOBLOCK)
        self.replays += 1
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.replay_timeout_s
        try:  # never blocks: a request to an engine that is not there waits in ZMQ's queue, one at most
            dealer.send_multipart((b"", _seq_bytes(start)), zmq.NOBLOCK)
        except zmq.ZMQError:
            deadline = 0.0  # the one before it still waits: as silent as no answer
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not dealer.poll(max(1, int(remaining * 1000))):
                self._back_off(start)
                return sorted(out) if out else None
            frames = dealer.recv_multipart()
            if not frames or frames[0] != b"":
                self.malformed += 1
                continue
            frames = frames[1:]
            if len(frames) >= 2 and frames[-2] == END_SEQ:
                self._retry_at, self._backoff_s = 0.0, self.replay_backoff_s
                return sorted(out)
            message = self._split(frames, live=False)
            if message is not None and message[0] >= start:
                out.append(message)

    def _back_off(self, start: int) -> None:
        """The replay socket did not answer: leave it alone for a while, twice as long as last time."""
        self.replay_failures += 1
        self._retry_at = time.monotonic() + self._backoff_s
        _log.warning(
            "KV event replay from %d of %r: no end marker in %.3g s; not asked again for %.3g s",
            start,
            self.worker,
            self.replay_timeout_s,
            self._backoff_s,
        )
        self._backoff_s = min(2 * self._backoff_s, self.replay_backoff_max_s)

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)

    def __enter__(self) -> ZmqEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pump_subscriber(
    subscriber: ZmqEventSubscriber,
    consumer: BatchConsumer,
    *,
    timeout_s: float = 0.0,
    max_count: int = 1000,
    on_batch: Callable[[EventBatch], None] | None = None,
) -> int:
    """Feed every batch ``subscriber`` has into ``consumer`` (an :class:`~kvblocks.events.EventConsumer`);
    return how many were applied. Waits up to ``timeout_s`` for the first, and one replay at most
    (:meth:`ZmqEventSubscriber.receive`). A batch whose feeding raises is
    logged and counted in ``consumer.feed_errors`` (its producer awaits a resync); malformed payloads are
    counted by the subscriber.
    """
    fed = 0
    for batch in subscriber.receive(timeout_s, max_count):
        if on_batch is not None:
            on_batch(batch)
        try:
            fed += bool(consumer.feed(batch))
        except Exception:
            consumer.feed_errors += 1
            _log.exception("feeding KV event batch %d of %r failed; it awaits a resync", batch.seq, batch.producer)
    return fed
