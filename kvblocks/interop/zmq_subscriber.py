"""Feed a vLLM or SGLang engine's KV events, read off its ZMQ publisher, to a kvblocks consumer (a
:class:`~kvblocks.routing.Router`'s :class:`~kvblocks.events.EventConsumer`): :class:`ZmqEventSubscriber`, with
the join, replays, resets and back-off told in :mod:`kvblocks.interop.zmq_events`, and :func:`pump_subscriber`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kvblocks.errors import ConfigError, EventDecodeError, InvalidArgumentError
from kvblocks.events.codec import EventBatch
from kvblocks.events.transport import BatchConsumer, receive_timeout
from kvblocks.interop.engine_wire import Dialect, EngineEventDecoder, _check_dialect
from kvblocks.interop.zmq_publisher import END_SEQ, _seconds, _seq_bytes, _text, require_zmq

__all__ = ["ZmqEventSubscriber", "pump_subscriber"]

_log = logging.getLogger("kvblocks.events")

_MAX_POLL_S = 1.0  # the longest single wait of a subscriber's poll (a longer wait is taken in slices)


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
