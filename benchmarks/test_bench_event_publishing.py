"""The cost of publishing KV events on the manager's hot path: the step lifecycle with and without.

The subject publishes every event the cache emits -- stored blocks with their token ids, block size
and LoRA, removals -- through an :class:`~kvblocks.events.EventPublisher`; the baseline is the same
lifecycle with no sink. The subjects:

* ``background``: vLLM's wire on a ZMQ PUB socket on loopback
  (:class:`kvblocks.interop.zmq_events.ZmqEventPublisher`), published with
  :meth:`~kvblocks.events.EventPublisher.start`: the engine thread only records its events
  (:meth:`~kvblocks.events.EventSink.record`); the publisher's thread drains the sink every 5 ms (the
  default interval of :meth:`~kvblocks.events.EventPublisher.start`), writes vLLM's msgpack straight from
  the sink's entries (:mod:`kvblocks.interop.fast_wire`) and sends. Measured on the engine thread's CPU clock
  (``time.thread_time``): the hot path's cost, the GIL hand-overs and garbage collections the other
  thread causes on it included. Target: at most 5% (ratio >= 0.95). Its wall-clock ratio, which on this
  2-core machine also pays for the other thread's work, is recorded beside it (report only).
* ``per-step``: the same transport with :meth:`~kvblocks.events.EventPublisher.publish` called at the
  end of every engine step, as vLLM's engine core does (report only).
* kvblocks' in-process transport per step, which encodes its JSON on the engine thread (report only).
"""

from __future__ import annotations

import time

import pytest

from kvblocks import KVCacheManager
from kvblocks.events import EventPublisher, EventSink
from kvblocks.events.transport import InProcessTransport

from .paired import paired_ratio
from .test_bench_manager import BLOCK_SIZE, CONCURRENCY, POOL, WORKLOAD
from .workloads import serve_chat_step


class _PublishingManager(KVCacheManager):
    """A manager whose every step ends by publishing what the step emitted (the engine's loop)."""

    publisher: EventPublisher

    def step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = super().step(*args, **kwargs)
        self.publisher.publish()
        return out


def _transport(kind: str):  # type: ignore[no-untyped-def]
    if kind == "in-process":
        return InProcessTransport(capacity=1 << 20)
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from kvblocks.interop.zmq_events import ZmqEventPublisher

    return ZmqEventPublisher("tcp://127.0.0.1:*", max_queue=1 << 20)


def _baseline() -> None:
    serve_chat_step(KVCacheManager(num_blocks=POOL, block_size=BLOCK_SIZE), WORKLOAD, CONCURRENCY)


@pytest.mark.parametrize(
    ("kind", "mode", "clock", "target"),
    [
        ("zmq-vllm", "background", "thread", 0.95),
        ("zmq-vllm", "background", "wall", None),
        ("zmq-vllm", "per-step", "thread", None),
        ("in-process", "per-step", "wall", None),
    ],
)
def test_publishing_events_on_the_step_lifecycle(
    benchmark, kind: str, mode: str, clock: str, target: float | None
) -> None:
    transport = _transport(kind)
    published: list[int] = []

    def subject() -> None:
        sink = EventSink()
        publisher = EventPublisher("bench", sink, transport)
        if mode == "background":
            manager = KVCacheManager(num_blocks=POOL, block_size=BLOCK_SIZE, event_sink=sink)
            publisher.start()
            serve_chat_step(manager, WORKLOAD, CONCURRENCY)
            publisher.stop()
        else:
            manager = _PublishingManager(num_blocks=POOL, block_size=BLOCK_SIZE, event_sink=sink)
            manager.publisher = publisher
            serve_chat_step(manager, WORKLOAD, CONCURRENCY)
            publisher.publish()
        published.append(publisher.events_sent)
        settle()  # every batch sent: the wall clock pays for the publisher thread's work too

    def settle() -> None:
        if isinstance(transport, InProcessTransport):
            transport.receive(max_count=1 << 20)
        elif not transport.flush(30.0):
            raise AssertionError("the publisher thread did not send the batches")

    try:
        ratio = paired_ratio(
            benchmark,
            f"event-publishing-{kind}-{mode}-{clock}-paired",
            f"step lifecycle publishing ({kind}, {mode}, {clock} clock)",
            _baseline,
            subject,
            baseline_name="step lifecycle, no events",
            target=target,
            rounds=31,
            clock=time.thread_time if clock == "thread" else time.perf_counter,
        )
    finally:
        transport.close()
    # every block the workload stores and evicts was published: thousands of events per run
    assert ratio > 0 and published and min(published) > WORKLOAD.working_set_blocks // 10
    if not isinstance(transport, InProcessTransport):
        assert transport.dropped == 0 and transport.errors == 0
