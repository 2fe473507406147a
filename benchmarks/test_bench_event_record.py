"""Recording a KV event on a cache's hot path (:meth:`EventSink.record`) against emitting it built.

One round: 4,096 ``BlockStored`` of 8 hashes and 128 token ids each (the shape of a prefill commit) go into a
sink -- as a cache records them (a factory bound to its tags and four arguments, the token ids as the bytes of
their ``array('I')`` slice; nothing is built) or as :meth:`~kvblocks.events.EventSink.emit` of the built
event (a :class:`BlockStored` with its tuple of hashes and token slice, and the record it returns). Both sinks
are then emptied without building anything, so the subject is what the engine thread pays. Target: >= 1.5.

    python -m pytest benchmarks/test_bench_event_record.py --benchmark-enable --benchmark-only
"""

from __future__ import annotations

import random
from array import array
from functools import partial

from kvblocks.events import BlockStored, EventSink
from kvblocks.events.codec import stored_event

from .paired import paired_ratio

EVENTS = 4096
_rng = random.Random(3)
HASHES = [_rng.randbytes(16) for _ in range(EVENTS + 8)]
TOKENS = array("I", (_rng.randrange(50_000) for _ in range(EVENTS * 16 + 128)))
FACTORY = partial(stored_event, "device", None, None, 16)


def _emit(sink: EventSink) -> None:
    for k in range(EVENTS):
        sink.emit(
            BlockStored(tuple(HASHES[k : k + 8]), HASHES[k - 1], "device", TOKENS[k * 16 : k * 16 + 128], block_size=16)
        )
    sink._take()


def _record(sink: EventSink) -> None:
    for k in range(EVENTS):
        sink.record(FACTORY, HASHES[k : k + 8], HASHES[k - 1], TOKENS[k * 16 : k * 16 + 128].tobytes(), None)
    sink._take()


def test_recording_events_vs_emitting_them_built(benchmark) -> None:
    emitting, recording = EventSink(capacity=EVENTS), EventSink(capacity=EVENTS)
    ratio = paired_ratio(
        benchmark,
        "event-record-paired",
        "EventSink.record of a factory and its arguments",
        lambda: _emit(emitting),
        lambda: _record(recording),
        baseline_name="EventSink.emit of the built BlockStored",
        target=1.5,
    )
    assert ratio > 0
    # the same events either way, once built
    _record(recording)
    recording.record(FACTORY, HASHES[0:8], None, TOKENS[0:128].tobytes(), None)
    built = recording.drain()[-1].event
    assert built == BlockStored(tuple(HASHES[0:8]), None, "device", tuple(TOKENS[0:128]), block_size=16)
