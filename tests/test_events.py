"""EventSink: numbering, delivery, bounded buffering."""

from __future__ import annotations

import pytest

from kvblocks import AllBlocksCleared, BlockRemoved, BlockStored, EventSink
from kvblocks.errors import ConfigError


def test_records_are_numbered_timestamped_and_delivered_in_order() -> None:
    ticks = iter([10.0, 11.0, 12.0])
    sink = EventSink(clock=lambda: next(ticks))
    seen: list = []
    unsubscribe = sink.subscribe(seen.append)
    sink.emit(BlockStored((b"a",), None, "device"))
    sink.emit(BlockRemoved((b"a",), "device"))
    unsubscribe()
    unsubscribe()  # twice is harmless
    sink.emit(AllBlocksCleared("device"))
    assert [(r.seq, r.timestamp) for r in seen] == [(0, 10.0), (1, 11.0)]
    assert [r.seq for r in sink.drain()] == [0, 1, 2]
    assert sink.next_seq == 3 and sink.drain() == []


def test_a_full_buffer_drops_the_oldest_and_leaves_a_visible_gap() -> None:
    sink = EventSink(capacity=2)
    for _ in range(5):
        sink.emit(AllBlocksCleared("device"))
    assert [r.seq for r in sink.drain()] == [3, 4]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_capacity(bad) -> None:
    with pytest.raises(ConfigError):
        EventSink(capacity=bad)
