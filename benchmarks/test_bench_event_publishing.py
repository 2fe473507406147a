"""The cost of publishing KV events on the manager's hot path: the step lifecycle with and without.

The subject publishes every event the cache emits -- stored blocks with their token ids, block size
and LoRA, removals -- through an :class:`~kvblocks.events.EventPublisher` once per engine step, as
an engine does: into kvblocks' in-process transport (JSON), and into vLLM's wire on a ZMQ PUB socket
on loopback (msgpack; :mod:`kvblocks.interop.zmq_events`) when pyzmq and msgspec are installed.
The baseline is the same lifecycle with no sink. Target: publishing adds at most 5%.
"""

from __future__ import annotations

import pytest

from kvblocks import KVCacheManager
from kvblocks.event_transport import InProcessTransport
from kvblocks.events import EventPublisher, EventSink

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
    zmq_events = pytest.importorskip("kvblocks.interop.zmq_events")
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    return zmq_events.ZmqEventPublisher("tcp://127.0.0.1:*")


def _publishing(transport) -> _PublishingManager:  # type: ignore[no-untyped-def]
    sink = EventSink()
    manager = _PublishingManager(num_blocks=POOL, block_size=BLOCK_SIZE, event_sink=sink)
    manager.publisher = EventPublisher("bench", sink, transport)
    return manager


def _drain(transport) -> None:  # type: ignore[no-untyped-def]
    if isinstance(transport, InProcessTransport):
        transport.receive(max_count=1 << 20)


@pytest.mark.parametrize("kind", ["in-process", "zmq-vllm"])
def test_publishing_events_costs_at_most_5_percent_of_the_step_lifecycle(benchmark, kind: str) -> None:
    transport = _transport(kind)
    try:
        published: list[int] = []

        def subject() -> None:
            manager = _publishing(transport)
            serve_chat_step(manager, WORKLOAD, CONCURRENCY)
            manager.publisher.publish()
            published.append(manager.publisher.events_sent)
            _drain(transport)

        ratio = paired_ratio(
            benchmark,
            f"event-publishing-{kind}-paired",
            f"step lifecycle publishing ({kind})",
            lambda: serve_chat_step(KVCacheManager(num_blocks=POOL, block_size=BLOCK_SIZE), WORKLOAD, CONCURRENCY),
            subject,
            baseline_name="step lifecycle, no events",
            target=0.95,
            rounds=9,
        )
    finally:
        transport.close()
    # every block the workload stores and evicts was published: thousands of events per run
    assert ratio > 0 and published and min(published) > WORKLOAD.working_set_blocks // 10
