"""AsyncWriter: the bounded background write queue of the storage tier."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.errors import ConfigError, InvalidArgumentError, KVBlocksError, SequenceStateError
from kvblocks.tiers import MemoryStorage
from kvblocks.tiers.writer import AsyncWriter, WriterStats

_names = itertools.count()


class RecordingStorage(MemoryStorage):
    """MemoryStorage that records every key handed to put(), and can hold put() until released.

    A gated storage lets a test freeze the writer thread inside its first batch, which makes
    everything submitted afterwards sit in the queue in a known order.
    """

    def __init__(self, *, gated: bool = False) -> None:
        super().__init__()
        self.put_keys: list[str] = []
        self.put_calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        if not gated:
            self.release.set()

    def preload(self, items: Sequence[tuple[str, bytes]]) -> None:
        MemoryStorage.put(self, items)  # behind the recorder's back: "already in storage"

    def put(self, items: Sequence[tuple[str, bytes]]) -> int:
        self.put_calls += 1
        self.put_keys.extend(key for key, _ in items)
        self.entered.set()
        self.release.wait(5)  # bounded: a broken test fails instead of hanging
        return super().put(items)

    def value(self, key: str) -> bytes | None:
        return self.get([key])[0]


def _thread_alive(name: str) -> bool:
    return any(t.name == name and t.is_alive() for t in threading.enumerate())


@pytest.fixture
def make_writer() -> Iterator[Callable[..., AsyncWriter]]:
    """Writers with unique thread names, released, closed and checked for a stopped thread afterwards."""
    made: list[tuple[AsyncWriter, Any, str]] = []

    def make(storage: Any, **kwargs: Any) -> AsyncWriter:
        name = f"test-writer-{next(_names)}"
        writer = AsyncWriter(storage, name=name, **kwargs)
        made.append((writer, storage, name))
        return writer

    yield make
    for writer, storage, name in made:
        release = getattr(storage, "release", None)
        if release is not None:
            release.set()
        writer.close(timeout=2)
        for thread in threading.enumerate():
            if thread.name == name:
                thread.join(2)
        assert not _thread_alive(name), f"{name} still running after close()"


def _stuck(make_writer: Callable[..., AsyncWriter], **kwargs: Any) -> tuple[AsyncWriter, RecordingStorage]:
    """A writer whose thread is blocked inside put() of a one-entry batch ("k0")."""
    storage = RecordingStorage(gated=True)
    writer = make_writer(storage, **kwargs)
    writer.submit([("k0", b"v0")])
    assert storage.entered.wait(2)
    return writer, storage


def _balanced(stats: WriterStats) -> bool:
    return stats.submitted == stats.written + stats.skipped_existing + stats.dropped + stats.failed


# ---------------------------------------------------------------- 1. the happy path


def test_everything_submitted_is_stored_after_flush(make_writer) -> None:
    storage = RecordingStorage()
    writer = make_writer(storage, batch_size=4)
    items = [(f"k{i}", bytes([i]) * 3) for i in range(10)]
    assert writer.submit(items[:6]) == 6
    assert writer.submit(items[6:]) == 4
    assert writer.flush(timeout=2)
    assert storage.get([k for k, _ in items]) == [v for _, v in items]
    stats = writer.stats.snapshot()
    assert (stats.submitted, stats.written, stats.skipped_existing, stats.dropped, stats.failed) == (10, 10, 0, 0, 0)
    assert 3 <= stats.batches <= 10  # at most batch_size per put(), at least one put per submit call
    assert sorted(storage.put_keys) == sorted(k for k, _ in items)
    assert writer.pending == 0


def test_stats_snapshot_is_a_copy() -> None:
    stats = WriterStats(submitted=2, written=1)
    copy = stats.snapshot()
    stats.written += 1
    assert copy == WriterStats(submitted=2, written=1) and copy is not stats


def test_values_are_copied_at_submit(make_writer) -> None:
    """A caller may reuse its buffer as soon as submit() returns; the write happens later."""
    writer, storage = _stuck(make_writer)
    buffer = bytearray(b"abc")
    writer.submit([("k1", buffer), ("k2", memoryview(buffer)[1:])])
    buffer[:] = b"xyz"
    storage.release.set()
    assert writer.flush(timeout=2)
    assert storage.get(["k1", "k2"]) == [b"abc", b"bc"]


# ---------------------------------------------------------------- 2. incremental writes


def test_keys_already_stored_are_not_put_again(make_writer) -> None:
    storage = RecordingStorage()
    storage.preload([("a", b"old"), ("c", b"old")])
    writer = make_writer(storage)
    writer.submit([("a", b"new"), ("b", b"new"), ("c", b"new"), ("d", b"new")])
    assert writer.flush(timeout=2)
    assert sorted(storage.put_keys) == ["b", "d"]
    assert storage.get(["a", "b", "c", "d"]) == [b"old", b"new", b"old", b"new"]
    stats = writer.stats
    assert (stats.submitted, stats.written, stats.skipped_existing, stats.batches) == (4, 2, 2, 1)
    # A second round of the same keys writes nothing at all.
    writer.submit([("a", b"x"), ("b", b"x")])
    assert writer.flush(timeout=2)
    assert sorted(storage.put_keys) == ["b", "d"] and writer.stats.skipped_existing == 4
    assert writer.stats.batches == 1  # no put() for a batch that was all there


def test_a_key_pending_twice_is_queued_once_and_the_first_value_wins(make_writer) -> None:
    writer, storage = _stuck(make_writer)
    assert writer.submit([("k1", b"first"), ("k2", b"v")]) == 2
    assert writer.submit([("k1", b"second")]) == 0
    assert writer.submit([("k3", b"v"), ("k3", b"again")]) == 1  # duplicates inside one call too
    assert writer.pending == 4  # k0 in flight, k1 k2 k3 queued
    storage.release.set()
    assert writer.flush(timeout=2)
    assert storage.put_keys.count("k1") == 1 and storage.value("k1") == b"first"
    assert storage.value("k3") == b"v"
    stats = writer.stats
    assert (stats.submitted, stats.written, stats.skipped_existing) == (6, 4, 2)


def test_a_key_resubmitted_while_in_flight_is_found_stored(make_writer) -> None:
    writer, storage = _stuck(make_writer)
    assert writer.submit([("k0", b"again")]) == 1  # k0 is in flight, not queued: queued again
    storage.release.set()
    assert writer.flush(timeout=2)
    assert storage.put_keys == ["k0"] and storage.value("k0") == b"v0"
    assert (writer.stats.written, writer.stats.skipped_existing) == (1, 1)


# ---------------------------------------------------------------- 3./4. a full queue


def test_a_full_queue_drops_the_oldest_entries(make_writer) -> None:
    writer, storage = _stuck(make_writer, max_pending=4, batch_size=2)
    for i in range(1, 10):
        assert writer.submit([(f"k{i}", b"v")]) == 1
    assert writer.pending == 5  # k0 in flight + k6..k9
    assert writer.stats.dropped == 5  # k1..k5, oldest first
    storage.release.set()
    assert writer.flush(timeout=2)
    stored = [f"k{i}" for i in range(10) if storage.value(f"k{i}") is not None]
    assert stored == ["k0", "k6", "k7", "k8", "k9"]
    assert storage.put_keys == ["k0", "k6", "k7", "k8", "k9"]
    stats = writer.stats
    assert (stats.submitted, stats.written, stats.dropped, stats.failed, stats.batches) == (10, 5, 5, 0, 3)


def test_one_submit_larger_than_the_queue_keeps_its_newest_entries(make_writer) -> None:
    writer, storage = _stuck(make_writer, max_pending=3)
    assert writer.submit([(f"k{i}", b"v") for i in range(1, 8)]) == 7
    storage.release.set()
    assert writer.flush(timeout=2)
    assert storage.put_keys == ["k0", "k5", "k6", "k7"] and writer.stats.dropped == 4


def test_submit_never_blocks_while_the_backend_is_stuck(make_writer) -> None:
    writer, storage = _stuck(make_writer, max_pending=64)
    start = time.perf_counter()
    for i in range(1, 2001):
        writer.submit([(f"k{i}", b"v" * 64)])
    writer.submit([(f"b{i}", b"v") for i in range(2000)])
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"4000 submits took {elapsed:.3f} s against a stuck backend"
    assert storage.put_calls == 1 and writer.pending == 65
    assert writer.stats.dropped == 4000 - 64


# ---------------------------------------------------------------- 5. faults


class _OnlyPut:
    def put(self, items: Sequence[tuple[str, bytes]]) -> int:
        return len(items)


class FlakyStorage(MemoryStorage):
    """put() raises on its first call, then works."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def put(self, items: Sequence[tuple[str, bytes]]) -> int:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("backend exploded")
        return super().put(items)


class ShortStorage(MemoryStorage):
    """put() writes only the LAST item of each batch and says it wrote one."""

    def put(self, items: Sequence[tuple[str, bytes]]) -> int:
        return super().put(list(items)[-1:])


def test_a_put_that_raises_counts_failed_and_the_thread_goes_on(make_writer, caplog) -> None:
    storage = FlakyStorage()
    stored: list[str] = []
    writer = make_writer(storage, on_stored=stored.extend)
    with caplog.at_level(logging.ERROR, logger="kvblocks.tiers"):
        writer.submit([("a", b"1"), ("b", b"2")])
        assert writer.flush(timeout=2)
    assert any("put() failed" in r.message and r.exc_info for r in caplog.records)
    assert (writer.stats.failed, writer.stats.written, writer.stats.batches) == (2, 0, 1)
    assert stored == [] and len(storage) == 0
    writer.submit([("c", b"3"), ("a", b"1")])  # a failed entry may be submitted again
    assert writer.flush(timeout=2)
    assert storage.get(["a", "c"]) == [b"1", b"3"] and sorted(stored) == ["a", "c"]
    assert (writer.stats.written, writer.stats.failed) == (2, 2) and _balanced(writer.stats)


def test_a_short_put_counts_the_rest_failed_and_reports_only_what_is_there(make_writer) -> None:
    storage = ShortStorage()
    stored: list[str] = []
    writer = make_writer(storage, on_stored=stored.extend)
    writer.submit([("a", b"1"), ("b", b"2"), ("c", b"3")])  # one call: one batch
    assert writer.flush(timeout=2)
    assert (writer.stats.written, writer.stats.failed) == (1, 2)
    assert stored == ["c"]  # the writer asked exists(); it did not guess "the first one"
    writer.submit([("d", b"4")])
    assert writer.flush(timeout=2)
    assert stored == ["c", "d"] and writer.stats.written == 2 and _balanced(writer.stats)


class ShortThenBlindStorage(ShortStorage):
    """A short put(), after which exists() breaks: the writer cannot learn what landed."""

    def __init__(self) -> None:
        super().__init__()
        self.exists_calls = 0

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.exists_calls += 1
        if self.exists_calls > 1:
            raise OSError("connection reset")
        return super().exists(keys)


def test_after_a_short_put_and_a_failed_check_only_keys_known_stored_are_reported(make_writer) -> None:
    storage = ShortThenBlindStorage()
    MemoryStorage.put(storage, [("x", b"old")])
    stored: list[str] = []
    writer = make_writer(storage, on_stored=stored.extend)
    writer.submit([("x", b"1"), ("a", b"1"), ("b", b"2")])
    assert writer.flush(timeout=2)
    assert stored == ["x"]  # "b" did land, but nobody could confirm it
    assert (writer.stats.written, writer.stats.failed, writer.stats.skipped_existing) == (1, 1, 1)


class BrokenExistsStorage(MemoryStorage):
    def __init__(self) -> None:
        super().__init__()
        self.broken = True

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if self.broken:
            raise OSError("connection reset")
        return super().exists(keys)


class NonsensePutStorage(MemoryStorage):
    def put(self, items: Sequence[tuple[str, bytes]]) -> Any:
        super().put(items)
        return None  # violates the protocol


def test_exists_raising_fails_the_batch_without_a_put(make_writer, caplog) -> None:
    storage = BrokenExistsStorage()
    writer = make_writer(storage)
    with caplog.at_level(logging.ERROR, logger="kvblocks.tiers"):
        writer.submit([("a", b"1"), ("b", b"2")])
        assert writer.flush(timeout=2)
    assert (writer.stats.failed, writer.stats.batches) == (2, 0) and len(storage) == 0
    assert any("exists() failed" in r.message for r in caplog.records)
    storage.broken = False
    writer.submit([("a", b"1")])
    assert writer.flush(timeout=2)
    assert storage.get(["a"]) == [b"1"]


def test_a_put_answer_that_is_not_an_int_counts_failed_but_reports_what_landed(make_writer) -> None:
    stored: list[str] = []
    writer = make_writer(NonsensePutStorage(), on_stored=stored.extend)
    writer.submit([("a", b"1")])
    assert writer.flush(timeout=2)
    assert (writer.stats.written, writer.stats.failed) == (0, 1)
    assert stored == ["a"]  # exists() says it is there, so the index may have it


# ---------------------------------------------------------------- 6. on_stored


def test_on_stored_gets_written_and_already_stored_keys(make_writer) -> None:
    storage = RecordingStorage()
    storage.preload([("x", b"old")])
    calls: list[list[str]] = []
    writer = make_writer(storage, batch_size=2, on_stored=calls.append)
    writer.submit([("x", b"1"), ("y", b"2"), ("z", b"3")])
    assert writer.flush(timeout=2)
    reported = [key for call in calls for key in call]
    assert sorted(reported) == ["x", "y", "z"] and len(reported) == 3
    assert all(len(call) <= 2 for call in calls)
    assert storage.put_keys == ["y", "z"]


def test_on_stored_runs_on_the_writer_thread(make_writer) -> None:
    threads: list[str] = []
    writer = make_writer(MemoryStorage(), on_stored=lambda keys: threads.append(threading.current_thread().name))
    writer.submit([("a", b"1")])
    assert writer.flush(timeout=2)
    assert len(threads) == 1 and threads[0].startswith("test-writer-")


def test_an_exception_in_on_stored_does_not_stop_the_writer(make_writer, caplog) -> None:
    calls: list[list[str]] = []

    def on_stored(keys: list[str]) -> None:
        calls.append(keys)
        if len(calls) == 1:
            raise ValueError("index full")

    storage = MemoryStorage()
    writer = make_writer(storage, on_stored=on_stored)
    with caplog.at_level(logging.ERROR, logger="kvblocks.tiers"):
        writer.submit([("a", b"1")])
        assert writer.flush(timeout=2)
    assert any("on_stored" in r.message and r.exc_info for r in caplog.records)
    writer.submit([("b", b"2")])
    assert writer.flush(timeout=2)
    assert calls == [["a"], ["b"]] and storage.get(["a", "b"]) == [b"1", b"2"]
    assert (writer.stats.written, writer.stats.failed) == (2, 0)  # the write itself succeeded


def test_flush_from_on_stored_is_refused_and_close_from_on_stored_does_not_deadlock(make_writer) -> None:
    errors: list[BaseException] = []
    holder: list[AsyncWriter] = []

    def on_stored(keys: list[str]) -> None:
        try:
            holder[0].flush(timeout=1)
        except KVBlocksError as error:
            errors.append(error)
        holder[0].close()

    writer = make_writer(MemoryStorage(), on_stored=on_stored)
    holder.append(writer)
    start = time.perf_counter()
    writer.submit([("a", b"1")])
    assert writer.flush(timeout=2)
    assert time.perf_counter() - start < 0.5  # flush did not sit out its own timeout
    assert len(errors) == 1 and isinstance(errors[0], SequenceStateError)
    assert writer.closed
    with pytest.raises(SequenceStateError):
        writer.submit([("b", b"2")])


# ---------------------------------------------------------------- 7. flush and close


def test_flush_times_out_while_stuck_and_succeeds_once_released(make_writer) -> None:
    writer, storage = _stuck(make_writer)
    writer.submit([("k1", b"v")])
    start = time.perf_counter()
    assert writer.flush(timeout=0.05) is False
    assert 0.04 <= time.perf_counter() - start < 0.5
    assert writer.pending == 2
    storage.release.set()
    assert writer.flush(timeout=2) is True
    assert writer.pending == 0 and writer.stats.written == 2


def test_flush_is_not_fooled_by_later_drops_while_a_batch_is_in_flight(make_writer) -> None:
    """Counting resolved entries is not enough: drops of newer entries must not end a flush
    that still waits for the in-flight k0."""
    writer, storage = _stuck(make_writer, max_pending=2)
    writer.submit([("k1", b"v")])
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(writer.flush(timeout=2)))
    waiter.start()
    try:
        time.sleep(0.02)  # let the waiter note what it waits for (k0, k1)
        writer.submit([(f"n{i}", b"v") for i in range(5)])  # drops k1, n0, n1, n2: 4 resolved >= 2
        waiter.join(0.05)
        assert result == [] and writer.stats.dropped == 4
    finally:
        storage.release.set()
        waiter.join(2)
    assert result == [True]
    assert storage.put_keys == ["k0", "n3", "n4"]


def test_flush_with_nothing_pending_returns_at_once(make_writer) -> None:
    writer = make_writer(MemoryStorage())
    start = time.perf_counter()
    assert writer.flush(timeout=0) is True and writer.flush() is True
    assert time.perf_counter() - start < 0.05


def test_close_writes_everything_and_stops_the_thread() -> None:
    storage = RecordingStorage()
    name = f"test-writer-{next(_names)}"
    writer = AsyncWriter(storage, name=name, batch_size=3)
    try:
        writer.submit([(f"k{i}", b"v") for i in range(10)])
        writer.close()
        assert writer.closed and writer.pending == 0
        assert sorted(storage.put_keys) == sorted(f"k{i}" for i in range(10))
        assert not _thread_alive(name)
        assert len(storage) == 10  # close() leaves the backend open: it belongs to the caller
    finally:
        writer.close(timeout=1)


def test_close_against_a_stuck_backend_returns_in_time_and_drops_the_rest(make_writer) -> None:
    writer, storage = _stuck(make_writer)
    writer.submit([("k1", b"v"), ("k2", b"v"), ("k3", b"v")])
    start = time.perf_counter()
    writer.close(timeout=0.1)
    elapsed = time.perf_counter() - start
    assert 0.09 <= elapsed < 0.6, elapsed
    assert writer.closed
    assert writer.stats.dropped == 3 and writer.pending == 1  # only k0, in flight, is left
    with pytest.raises(SequenceStateError):
        writer.submit([("k4", b"v")])
    start = time.perf_counter()
    writer.close(timeout=5)  # idempotent, and does not wait again
    assert time.perf_counter() - start < 0.05
    # The backend answers at last: the in-flight batch is counted, nothing is counted twice.
    storage.release.set()
    assert writer.flush(timeout=2)
    assert storage.put_keys == ["k0"] and storage.value("k1") is None
    stats = writer.stats
    assert (stats.submitted, stats.written, stats.dropped, stats.failed) == (4, 1, 3, 0) and _balanced(stats)


def test_a_closed_writer_refuses_entries_and_changes_nothing(make_writer) -> None:
    writer = make_writer(MemoryStorage())
    writer.close()
    writer.close()
    before = writer.stats.snapshot()
    with pytest.raises(SequenceStateError):
        writer.submit([("a", b"1")])
    with pytest.raises(SequenceStateError):
        writer.submit([])
    assert writer.stats == before


# ---------------------------------------------------------------- 8. bad arguments


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_pending": 0}, "max_pending"),
        ({"max_pending": -1}, "max_pending"),
        ({"max_pending": True}, "max_pending"),
        ({"max_pending": 2.0}, "max_pending"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": "8"}, "batch_size"),
        ({"on_stored": 42}, "on_stored"),
        ({"name": None}, "name"),
    ],
)
def test_bad_configuration_raises_config_error(kwargs: dict[str, Any], match: str) -> None:
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ConfigError, match=match):
        AsyncWriter(MemoryStorage(), **kwargs)
    assert {t.ident for t in threading.enumerate()} <= before  # no thread was started


@pytest.mark.parametrize("storage", [object(), {"put": 1}, _OnlyPut()])
def test_a_storage_without_put_and_exists_is_refused(storage: Any) -> None:
    with pytest.raises(ConfigError, match="put\\(\\) and exists\\(\\)"):
        AsyncWriter(storage)


@pytest.mark.parametrize(
    "items",
    [
        [("ok", b"1"), ("bad", "not bytes")],
        [("ok", b"1"), ("UPPER", b"1")],
        [("ok", b"1"), ("../etc", b"1")],
        [("ok", b"1"), (7, b"1")],
        [("ok", b"1"), ("short",)],
        [("ok", b"1"), ("a", b"1", b"2")],
        [("ok", b"1"), "ab"],
        [("ok", b"1"), None],
        "ab",
        b"ab",
        {("ok", b"1")},
        None,
    ],
)
def test_bad_items_raise_and_queue_none_of_them(make_writer, items: Any) -> None:
    writer, storage = _stuck(make_writer)
    writer.submit([("k1", b"v")])
    before = writer.stats.snapshot()
    with pytest.raises(InvalidArgumentError):
        writer.submit(items)
    assert writer.stats == before and writer.pending == 2
    storage.release.set()
    assert writer.flush(timeout=2)
    assert storage.put_keys == ["k0", "k1"]


@pytest.mark.parametrize("timeout", [-1, float("nan"), "1", True])
def test_bad_timeouts_raise(make_writer, timeout: Any) -> None:
    writer = make_writer(MemoryStorage())
    with pytest.raises(InvalidArgumentError):
        writer.flush(timeout)
    with pytest.raises(InvalidArgumentError):
        writer.close(timeout)
    assert not writer.closed  # a refused close() changed nothing


# ---------------------------------------------------------------- 9. properties

ALPHABET = st.sampled_from(["a", "b", "c", "d", "e", "f"])
CALLS = st.lists(st.lists(st.tuples(ALPHABET, st.binary(max_size=3)), max_size=6), max_size=8)


@settings(max_examples=60)
@given(calls=CALLS, preloaded=st.sets(ALPHABET), max_pending=st.integers(1, 4), batch_size=st.integers(1, 3))
def test_a_frozen_writer_matches_the_queue_model(
    calls: list[list[tuple[str, bytes]]], preloaded: set[str], max_pending: int, batch_size: int
) -> None:
    """With the thread held inside a first batch, every submit lands in a queue of known state.

    The model: a FIFO of at most ``max_pending`` keys; a key already queued is skipped (its
    first value wins); a full queue drops its oldest entry. After release the thread drains it
    in chunks of ``batch_size``, skipping keys the backend already holds.
    """
    storage = RecordingStorage(gated=True)
    storage.preload([(key, b"old") for key in preloaded])
    reported: list[str] = []
    writer = AsyncWriter(storage, max_pending=max_pending, batch_size=batch_size, on_stored=reported.extend)
    try:
        writer.submit([("sentinel", b"s")])
        assert storage.entered.wait(2)
        queue: OrderedDict[str, bytes] = OrderedDict()
        dropped = skipped = 0
        for call in calls:
            queued = 0
            for key, value in call:
                if key in queue:
                    skipped += 1
                    continue
                if len(queue) >= max_pending:
                    queue.popitem(last=False)
                    dropped += 1
                queue[key] = value
                queued += 1
            assert writer.submit(call) == queued
        assert writer.pending == 1 + len(queue)
        storage.release.set()
        assert writer.flush(timeout=5)

        order = list(queue)
        new = [key for key in order if key not in preloaded]
        chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        expected = WriterStats(
            submitted=1 + sum(len(call) for call in calls),
            written=1 + len(new),
            skipped_existing=skipped + len(order) - len(new),
            dropped=dropped,
            failed=0,
            batches=1 + sum(1 for chunk in chunks if any(key not in preloaded for key in chunk)),
        )
        assert writer.stats == expected and _balanced(writer.stats)
        assert storage.put_keys == ["sentinel", *new]
        for key in "abcdef":
            want = b"old" if key in preloaded else queue.get(key)
            assert storage.value(key) == want
        assert sorted(reported) == sorted(["sentinel", *order])
    finally:
        storage.release.set()
        writer.close(timeout=2)


@settings(max_examples=60)
@given(calls=CALLS, preloaded=st.sets(ALPHABET), max_pending=st.integers(1, 4), batch_size=st.integers(1, 3))
def test_a_free_running_writer_keeps_its_invariants(
    calls: list[list[tuple[str, bytes]]], preloaded: set[str], max_pending: int, batch_size: int
) -> None:
    """Whatever the thread's timing: every entry is accounted once, nothing is written twice, and
    without drops every key ends up stored with the first value submitted for it."""
    storage = RecordingStorage()
    storage.preload([(key, b"old") for key in preloaded])
    reported: list[str] = []
    writer = AsyncWriter(storage, max_pending=max_pending, batch_size=batch_size, on_stored=reported.extend)
    try:
        for call in calls:
            writer.submit(call)
        assert writer.flush(timeout=5)
        stats = writer.stats
        assert stats.submitted == sum(len(call) for call in calls)
        assert _balanced(stats) and stats.failed == 0
        assert len(storage.put_keys) == len(set(storage.put_keys)) == stats.written
        stored = {key for key in "abcdef" if storage.value(key) is not None}
        assert stored == preloaded | set(storage.put_keys)
        assert set(reported) <= stored and set(storage.put_keys) <= set(reported)
        submitted: dict[str, list[bytes]] = {}
        for key, value in itertools.chain.from_iterable(calls):
            submitted.setdefault(key, []).append(value)
        for key in storage.put_keys:
            assert storage.value(key) in submitted[key]
        if stats.dropped == 0:
            assert set(submitted) <= stored
            for key, values in submitted.items():
                assert storage.value(key) == (b"old" if key in preloaded else values[0])
    finally:
        writer.close(timeout=2)
