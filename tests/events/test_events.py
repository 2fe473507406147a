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


def test_a_failing_subscriber_cannot_break_the_cache(caplog) -> None:
    """The tree has changed by the time it emits; a subscriber's exception must not abort the caller."""
    from kvblocks import KVCacheManager

    sink = EventSink()
    seen: list = []

    def broken(record) -> None:
        raise RuntimeError("subscriber bug")

    sink.subscribe(broken)
    sink.subscribe(seen.append)  # later subscribers still get the event
    m = KVCacheManager(num_blocks=4, block_size=2, event_sink=sink)
    m.add_sequence("a", [1, 2, 3])
    m.allocate("a", 3)
    m.commit("a", 3)  # emits BlockStored: the broken subscriber raises inside
    m.check_integrity()
    assert m.num_computed_tokens("a") == 3 and len(m.tree) == 1
    assert sink.subscriber_errors == 1 and len(seen) == 1
    assert "subscriber bug" in caplog.text


def test_the_old_module_paths_are_the_package_s_modules_names() -> None:
    """``kvblocks.event_codec`` and ``kvblocks.event_transport`` (before the events became a package) still import,
    every name the modules export being the package module's own object."""
    import kvblocks.event_codec as old_codec
    import kvblocks.event_transport as old_transport
    from kvblocks.events import codec, transport

    for old, new in ((old_codec, codec), (old_transport, transport)):
        assert set(new.__all__) <= set(old.__all__)
        assert all(getattr(old, name) is getattr(new, name) for name in old.__all__)


def test_the_events_package_keeps_its_names_and_its_modules_stay_short() -> None:
    from pathlib import Path

    import kvblocks.events

    assert {name for name in kvblocks.events.__all__ if not hasattr(kvblocks.events, name)} == set()
    lengths = {p.name: len(p.read_text().splitlines()) for p in Path(kvblocks.events.__file__).parent.glob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 600} == {}
