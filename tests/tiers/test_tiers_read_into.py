"""Reads straight into place (FileStorage.get_into, StorageTier.read_into) and entries built in place
(EntryFormat.encode_into, StorageTier.save_built, EntryPool). The oracle is the one-shot path:
EntryFormat.encode / decode and StorageTier.read, which these must agree with byte for byte."""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvblocks.errors import ConfigError, InvalidArgumentError, SequenceStateError
from kvblocks.hashing import Namespace
from kvblocks.tiers import FileStorage, MemoryStorage, file_storage
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.entry import HEADER, EntryFormat, StreamedChecksum, block_key
from kvblocks.tiers.storage_tier import StorageTier
from kvblocks.tiers.writer import BUFFER_ALIGNMENT, AsyncWriter, EntryPool, aligned_buffer
from tests.support.damage import damaged

FMT = EntryFormat("xxh3-128", "float16", (2, 2, 4, 8), 7, 2 * 2 * 4 * 8 * 2)  # 256-byte payloads
KEY = block_key("0123456789abcdef", "xxh3-128", b"\x01" * 16, format_tag=FMT.tag)
OTHER_KEY = block_key("0123456789abcdef", "xxh3-128", b"\x02" * 16, format_tag=FMT.tag)
SPLITS = [0, 1, 64, 100, 255, 256]


def parts_of(sizes: Sequence[int]) -> list[bytearray]:
    """Buffers of the given sizes covering one payload (what a block's layer views are)."""
    return [bytearray(n) for n in sizes]


def split_sizes(cuts: Sequence[int]) -> list[int]:
    points = sorted({0, FMT.payload_length, *cuts})
    return [b - a for a, b in itertools.pairwise(points)]


def read_into_reason(
    storage: FileStorage, key: str, sizes: Sequence[int], run_bytes: int | None = None
) -> tuple[str, bytes]:
    """The check of ``key`` read into buffers of ``sizes``: the checksum taken after the read (``run_bytes``
    None), or streamed as the read lands in runs of ``run_bytes`` (what ``StorageTier.read_into`` does)."""
    header = bytearray(HEADER.size)
    parts = parts_of(sizes)
    if run_bytes is None:
        return FMT.check_read(header, storage.get_into(key, [header, *parts]), parts, key), b"".join(parts)
    streamed = StreamedChecksum()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(file_storage, "READ_RUN_BYTES", run_bytes)
        length = storage.get_into(key, [header, *parts], on_read=streamed.start())
    return FMT.check_read(header, length, parts, key, streamed), b"".join(parts)


# ------------------------------------------------------------------ encode_into == encode


@settings(max_examples=100, deadline=None)
@given(payload=st.binary(min_size=256, max_size=256), bound=st.booleans())
def test_an_entry_built_in_place_is_the_encoded_entry(payload: bytes, bound: bool) -> None:
    key = KEY if bound else None
    entry = bytearray(os.urandom(FMT.entry_length))  # a reused buffer: stale bytes everywhere
    entry[HEADER.size :] = payload
    FMT.encode_into(entry, key)
    assert bytes(entry) == FMT.encode(payload, key)


# ------------------------------------------------------------------ get_into vs get + decode


@settings(max_examples=60, deadline=None)
@given(payload=st.binary(min_size=256, max_size=256), cuts=st.lists(st.sampled_from(SPLITS), max_size=4))
def test_get_into_round_trips_what_get_reads(tmp_path_factory: pytest.TempPathFactory, payload: bytes, cuts) -> None:
    storage = FileStorage(tmp_path_factory.mktemp("s"))
    storage.put([(KEY, FMT.encode(payload, KEY))])
    reason, got = read_into_reason(storage, KEY, split_sizes(cuts))
    decoded, why = FMT.decode(storage.get([KEY])[0], KEY)
    assert reason == why == "" and got == bytes(decoded) == payload  # type: ignore[arg-type]
    assert storage.stats.hits == 2 and storage.stats.misses == 0


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_files_get_the_reason_decode_gives(tmp_path: Path, data: st.DataObject) -> None:
    """Whatever bytes a file holds, reading into place finds what the one-shot decode finds, never raises."""
    storage = FileStorage(tmp_path)
    entry = FMT.encode(data.draw(st.binary(min_size=256, max_size=256)), KEY)
    raw = damaged(entry, data)
    path = Path(storage._file(KEY))
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(raw)
    sizes = split_sizes(data.draw(st.lists(st.sampled_from(SPLITS))))
    payload, why = FMT.decode(raw, KEY)
    for run_bytes in (None, data.draw(st.sampled_from([1, 50, HEADER.size, 200, 1 << 20]))):
        reason, got = read_into_reason(storage, KEY, sizes, run_bytes)
        assert reason == why
        if not reason:
            assert got == bytes(payload)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(0, 40), max_size=40),
    stored=st.integers(0, 900),
    run_bytes=st.integers(1, 120),
    iov_max=st.sampled_from([1, 2, 3, 16]),
)
def test_on_read_gets_each_full_buffer_once_in_order_in_runs(
    tmp_path: Path, sizes: list[int], stored: int, run_bytes: int, iov_max: int
) -> None:
    """``get_into``'s ``on_read`` sees exactly the buffers the file filled, in order, each once, in runs of
    at least READ_RUN_BYTES (all but the last) and at most IOV_MAX buffers, after their bytes landed."""
    storage = FileStorage(tmp_path)
    content = os.urandom(stored)
    path = Path(storage._file(KEY))
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content)
    buffers = parts_of(sizes)
    runs: list[list[bytes]] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(file_storage, "READ_RUN_BYTES", run_bytes)
        patch.setattr(file_storage, "_IOV_MAX", iov_max)
        length = storage.get_into(KEY, buffers, on_read=lambda run: runs.append([bytes(v) for v in run]))
    assert length == stored
    handed = [part for run in runs for part in run]
    full = 0  # how many leading buffers the file fills whole
    for end in itertools.accumulate(sizes):
        if end > stored:
            break
        full += 1
    assert [len(part) for part in handed] == sizes[:full]  # the full ones, in order, each once
    assert b"".join(handed) == content[: sum(sizes[:full])]  # with their bytes in place when handed on
    assert all(0 < len(run) <= iov_max and sum(map(len, run[:-1])) < run_bytes for run in runs)  # no overshoot
    assert all(sum(map(len, run)) >= run_bytes or len(run) == iov_max for run in runs[:-1])  # no run cut short


@settings(max_examples=100, deadline=None)
@given(
    header=st.binary(min_size=1, max_size=HEADER.size),
    payload=st.binary(max_size=600),
    cuts=st.lists(st.integers(0, 600), max_size=6),
    groups=st.lists(st.integers(1, 4), min_size=8, max_size=8),
)
def test_a_streamed_checksum_is_the_payloads_xxh3_however_it_is_fed(
    header: bytes, payload: bytes, cuts: list[int], groups: list[int]
) -> None:
    points = sorted({0, len(payload), *(c for c in cuts if c <= len(payload))})
    parts = [memoryview(header)] + [memoryview(payload[a:b]) for a, b in itertools.pairwise(points)]
    streamed = StreamedChecksum()
    streamed(parts)  # a stale entry first: start() forgets it
    streamed.start()
    fed = 0
    for size in itertools.cycle(groups):
        if fed >= len(parts):
            break
        streamed(parts[fed : fed + size])
        fed += size
    assert streamed.intdigest() == xxhash.xxh3_64_intdigest(payload) and streamed.payload_bytes == len(payload)


def test_a_payload_streamed_short_is_a_truncated_one() -> None:
    """The file's length said whole, but fewer bytes reached the checksum (the file shrank mid-read)."""
    payload = os.urandom(FMT.payload_length)
    entry = FMT.encode(payload, KEY)
    header, parts = bytearray(entry[: HEADER.size]), [bytearray(payload)]
    streamed = StreamedChecksum().start()
    streamed([memoryview(header)])
    assert FMT.check_read(header, len(entry), parts, KEY, streamed) == "truncated payload"
    streamed([memoryview(parts[0])])
    assert FMT.check_read(header, len(entry), parts, KEY, streamed) == ""
    parts[0][0] ^= 1  # the buffer changed after it was checksummed: the streamed sum is what counts
    assert FMT.check_read(header, len(entry), parts, KEY, streamed) == ""
    assert FMT.check_read(header, len(entry), parts, KEY) == "checksum mismatch"


def test_an_entry_under_another_key_and_a_missing_one(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path)
    entry = FMT.encode(bytes(256), OTHER_KEY)
    path = Path(storage._file(KEY))
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(entry)
    assert read_into_reason(storage, KEY, [256])[0] == "written under another key"
    path.unlink()
    assert read_into_reason(storage, KEY, [256])[0] == "absent"
    assert storage.stats.misses == 1 and storage.stats.hits == 1


def test_an_unreadable_file_is_a_counted_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = FileStorage(tmp_path)
    storage.put([(KEY, FMT.encode(bytes(256), KEY))])
    real_open = os.open

    def denied(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).endswith(KEY):
            raise PermissionError(13, "denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)  # get_into opens with os.open (no io object per entry)
    assert storage.get_into(KEY, [bytearray(HEADER.size), bytearray(256)]) is None
    assert storage.stats.get_errors == 1 and storage.stats.misses == 1


def test_more_buffers_than_one_preadv_takes(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path)
    payload = os.urandom(256)
    storage.put([(KEY, FMT.encode(payload, KEY))])
    reason, got = read_into_reason(storage, KEY, [1] * 256)  # 257 buffers, one byte each ...
    assert reason == "" and got == payload
    fmt = EntryFormat("xxh3-128", "uint8", (4000,), 1, 4000)
    big = os.urandom(4000)
    key = block_key("0123456789abcdef", "xxh3-128", b"\x03" * 16, format_tag=fmt.tag)
    storage.put([(key, fmt.encode(big, key))])
    header, parts = bytearray(HEADER.size), [bytearray(1) for _ in range(4000)]  # ... and more than IOV_MAX
    assert fmt.check_read(header, storage.get_into(key, [header, *parts]), parts, key) == ""
    assert b"".join(parts) == big


# ------------------------------------------------------------------ StorageTier.read_into vs read


def tier_on(storage: object, **kwargs: object) -> StorageTier:
    """A storage tier over ``storage`` (keyword arguments: StorageTier's)."""
    return StorageTier(
        TierConfig(storage=storage, entry_format=FMT),  # type: ignore[arg-type]
        Namespace("m"),
        "xxh3-128",
        16,
        **kwargs,  # type: ignore[arg-type]
    )


STATES = st.sampled_from(["sound", "absent", "corrupt", "truncated", "wrong-key", "foreign"])


def plant(tier: StorageTier, hashes: list[bytes], states: list[str]) -> list[bytes]:
    """Write each block's entry in the given state straight into the backend; the payloads."""
    payloads = [bytes([i + 1]) * 256 for i in range(len(hashes))]
    foreign = EntryFormat("xxh3-128", "bfloat16", (2, 2, 4, 8), 7, 256)
    items = []
    for h, state, payload in zip(hashes, states, payloads, strict=True):
        (key,) = tier.keys_of(h)
        entry = FMT.encode(payload, key)
        value = {
            "sound": entry,
            "corrupt": entry[:-1] + bytes([entry[-1] ^ 1]),
            "truncated": entry[:200],
            "wrong-key": FMT.encode(payload, OTHER_KEY),
            "foreign": foreign.encode(payload, key),
        }.get(state)
        if value is not None:
            items.append((key, value))
    tier.backend.put(items)
    return payloads


@pytest.mark.parametrize("backend", ["file", "file-shared", "memory"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(states=st.lists(STATES, min_size=1, max_size=6))
def test_read_into_agrees_with_read(tmp_path_factory: pytest.TempPathFactory, backend: str, states) -> None:
    """Same leading run, same payloads, same stats, same index, same entries left: for a backend that
    reads into place (files; "shared": every read of two blocks or more split with the helper thread)
    and one that does not (memory: read + copy)."""
    hashes = [bytes([i]) * 16 for i in range(len(states))]

    def fresh() -> StorageTier:
        storage = MemoryStorage() if backend == "memory" else FileStorage(tmp_path_factory.mktemp("t"))
        tier = tier_on(storage, shared_read_bytes=0 if backend == "file-shared" else None)
        tier._remember(hashes)
        return tier

    one, other = fresh(), fresh()
    try:
        payloads = plant(one, hashes, states)
        plant(other, hashes, states)
        outcome = one.read(hashes)
        targets = [[bytearray(100), bytearray(156)] for _ in hashes]
        usable = other.read_into(hashes, targets)
        assert usable == len(outcome.payloads) == next((i for i, s in enumerate(states) if s != "sound"), len(states))
        assert [b"".join(t) for t in targets[:usable]] == payloads[:usable]
        assert one.stats == other.stats
        assert one.known_hashes() == other.known_hashes()
        keys = [k for h in hashes for k in one.keys_of(h)]
        assert one.backend.exists(keys) == other.backend.exists(keys)
    finally:
        one.close()
        other.close()


def test_read_into_refuses_bad_targets_before_reading(tmp_path: Path) -> None:
    tier = tier_on(FileStorage(tmp_path))
    try:
        with pytest.raises(InvalidArgumentError):
            tier.read_into([b"\x01" * 16], [[bytearray(255)]])  # one byte short
        with pytest.raises(InvalidArgumentError):
            tier.read_into([b"\x01" * 16], [[bytes(256)]])  # read-only
        with pytest.raises(InvalidArgumentError):
            tier.read_into([b"\x01" * 16], [])
        assert tier.stats.loads_requested == 0 and tier.backend.stats.gets == 0
    finally:
        tier.close()


def test_a_raising_backend_makes_every_block_a_counted_miss(tmp_path: Path) -> None:
    class Broken(FileStorage):
        def get_into(self, key: str, buffers: Sequence[object], on_read: object = None) -> int | None:
            raise RuntimeError("bug")

    tier = tier_on(Broken(tmp_path))
    try:
        assert tier.read_into([b"\x01" * 16, b"\x02" * 16], [[bytearray(256)], [bytearray(256)]]) == 0
        assert tier.stats.load_errors == 2 and tier.stats.loads_requested == 2
    finally:
        tier.close()


class Watched(FileStorage):
    """A FileStorage that records which thread read each key, and how many reads are under way."""

    def __init__(self, root: Path, fail: str | None = None) -> None:
        super().__init__(root)
        self.fail = fail
        self.readers: dict[str, list[str]] = {}
        self.in_flight = 0
        self.peak = 0
        self._watch = threading.Lock()

    def get_into(self, key: str, buffers: Sequence[object], on_read: Any = None) -> int | None:
        with self._watch:
            self.readers.setdefault(key, []).append(threading.current_thread().name)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            threading.Event().wait(0.002)  # long enough that the helper gets its turns
            if key == self.fail:
                raise RuntimeError("bug")
            return super().get_into(key, buffers, on_read)
        finally:
            with self._watch:
                self.in_flight -= 1


def test_a_shared_read_uses_both_threads_and_reads_each_entry_once(tmp_path: Path) -> None:
    tier = tier_on(Watched(tmp_path), shared_read_bytes=0)
    try:
        hashes = [bytes([i + 1]) * 16 for i in range(24)]
        payloads = plant(tier, hashes, ["sound"] * len(hashes))
        targets = [[bytearray(56), bytearray(200)] for _ in hashes]
        assert tier.read_into(hashes, targets) == len(hashes)
        storage: Watched = tier.backend  # type: ignore[assignment]
        assert storage.in_flight == 0 and storage.peak == 2  # both threads at once, and done on return
        assert all(len(names) == 1 for names in storage.readers.values()) and len(storage.readers) == len(hashes)
        threads = {name for names in storage.readers.values() for name in names}
        assert len(threads) == 2 and any(name.startswith("kvblocks-storage-read-helper") for name in threads)
        assert [b"".join(t) for t in targets] == payloads
        assert tier.stats.loads_hit == len(hashes) and tier.backend.stats.hits == len(hashes)
    finally:
        tier.close()


@pytest.mark.parametrize("failing", [0, 5, 11])
def test_a_bug_on_either_thread_is_a_whole_miss_returned_once_both_stopped(tmp_path: Path, failing: int) -> None:
    hashes = [bytes([i + 1]) * 16 for i in range(12)]
    tier = tier_on(FileStorage(tmp_path), shared_read_bytes=0)
    (fail,) = tier.keys_of(hashes[failing])
    tier.close()
    tier = tier_on(Watched(tmp_path, fail=fail), shared_read_bytes=0)
    try:
        plant(tier, hashes, ["sound"] * len(hashes))
        assert tier.read_into(hashes, [[bytearray(256)] for _ in hashes]) == 0
        storage: Watched = tier.backend  # type: ignore[assignment]
        assert storage.in_flight == 0  # no read still writing into the caller's buffers
        assert tier.stats.load_errors == len(hashes) and tier.stats.loads_hit == 0
    finally:
        tier.close()


def test_small_reads_and_a_closed_tier_read_on_the_calling_thread(tmp_path: Path) -> None:
    hashes = [bytes([i + 1]) * 16 for i in range(4)]
    for limit, close_first in [(4 * 256 + 1, False), (None, False), (0, True)]:
        tier = tier_on(Watched(tmp_path / f"{limit}-{close_first}"), shared_read_bytes=limit)
        try:
            payloads = plant(tier, hashes, ["sound"] * len(hashes))
            if close_first:
                tier.close()
            targets = [[bytearray(256)] for _ in hashes]
            assert tier.read_into(hashes, targets) == len(hashes)
            storage: Watched = tier.backend  # type: ignore[assignment]
            assert {n for names in storage.readers.values() for n in names} == {threading.current_thread().name}
            assert [bytes(t[0]) for t in targets] == payloads
        finally:
            tier.close()


def test_shared_read_bytes_is_checked(tmp_path: Path) -> None:
    for bad in (-1, True, 1.5, "1"):
        with pytest.raises(ConfigError):
            tier_on(FileStorage(tmp_path), shared_read_bytes=bad)


# ------------------------------------------------------------------ save_built and the pool


def test_entries_built_in_place_read_back_through_get_and_get_into(tmp_path: Path) -> None:
    tier = tier_on(FileStorage(tmp_path))
    try:
        hashes = [bytes([i]) * 16 for i in range(5)]
        payloads = [os.urandom(256) for _ in hashes]

        def fill(i: int, out: memoryview) -> None:
            out[:] = payloads[i]

        tier.save_built(hashes, fill)
        assert tier.flush(10.0) and tier.known_hashes() == hashes
        for h, payload in zip(hashes, payloads, strict=True):
            (key,) = tier.keys_of(h)
            raw = tier.backend.get([key])[0]
            assert raw == FMT.encode(payload, key)  # the format is unchanged: old readers read it
        targets = [[bytearray(256)] for _ in hashes]
        assert tier.read_into(hashes, targets) == 5 and [bytes(t[0]) for t in targets] == payloads
        assert tier.entry_pool.created <= 5 and tier.entry_pool.free == tier.entry_pool.created
    finally:
        tier.close()


def test_a_fill_that_raises_queues_nothing_more_and_returns_its_buffer(tmp_path: Path) -> None:
    tier = tier_on(FileStorage(tmp_path))
    try:

        def fill(i: int, out: memoryview) -> None:
            if i == 1:
                raise InvalidArgumentError("bad block")
            out[:] = bytes(256)

        with pytest.raises(InvalidArgumentError):
            tier.save_built([b"\x01" * 16, b"\x02" * 16, b"\x03" * 16], fill)
        assert tier.flush(10.0) and tier.writer.stats.submitted == 1 and tier.stats.saves_queued == 1
        assert tier.entry_pool.free == tier.entry_pool.created == 2
    finally:
        tier.close()


class GatedStorage(MemoryStorage):
    """A backend whose put waits for a gate, and records what each put saw (copies, at put time)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.seen: dict[str, bytes] = {}

    def put(self, items: Sequence[tuple[str, bytes | bytearray]]) -> int:
        self.gate.wait(10.0)
        for key, value in items:
            self.seen[key] = bytes(value)
        return super().put(items)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["submit", "open", "flush", "dup"]), st.integers(0, 255)), max_size=40),
    max_pending=st.integers(1, 4),
)
def test_the_pool_never_hands_out_a_buffer_still_queued(ops, max_pending: int) -> None:
    """Under a full queue (oldest dropped), duplicates and a stalled backend: every buffer taken is owned by
    nobody else, and every entry the backend stored holds exactly the bytes it was built with."""
    storage = GatedStorage()
    pool = EntryPool(8, max_free=3)
    writer = AsyncWriter(storage, max_pending=max_pending, batch_size=2)
    built: dict[str, set[bytes]] = {}  # each key's contents as submitted (a dropped one may come again)
    serial = 0
    try:
        for op, byte in ops:
            if op == "open":
                storage.gate.set()
                continue
            if op == "flush":
                storage.gate.set()
                assert writer.flush(10.0)
                storage.gate.clear()
                continue
            buffer = pool.take()
            with writer._lock:
                held = [e.value for e in writer._queue.values()] + [e.value for e in writer._in_flight]
            assert all(buffer is not value for value in held)
            serial += 1
            key = f"k{serial}" if op == "submit" or not built else next(iter(built))
            content = bytes([byte, serial & 0xFF]) * 4
            buffer[:] = content
            built.setdefault(key, set()).add(content)
            writer.submit([(key, buffer)], pool=pool)
        storage.gate.set()
        assert writer.flush(10.0)
        stats = writer.stats
        assert stats.submitted == stats.written + stats.skipped_existing + stats.dropped + stats.failed
        for key, value in storage.seen.items():
            assert value in built[key]  # as built for that key (its serial inside), untouched by later reuse
        assert pool.free <= 3
    finally:
        storage.gate.set()
        writer.close(5.0)


def address_of(buffer: bytearray | memoryview) -> int:
    probe = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


@settings(max_examples=100, deadline=None)
@given(size=st.integers(1, 5 << 20), alignment=st.sampled_from([1, 2, 16, 64, 4096]))
def test_aligned_buffers_start_on_the_boundary_zeroed_and_whole(size: int, alignment: int) -> None:
    """On the boundary for every size (a bytearray trimmed into place was aligned only from ``alignment`` bytes
    up, and only where CPython kept its start)."""
    buffer = aligned_buffer(size, alignment)
    assert type(buffer) is memoryview and buffer.format == "B" and not buffer.readonly
    assert len(buffer) == buffer.nbytes == size and bytes(buffer).count(0) == size
    assert address_of(buffer) % alignment == 0
    buffer[-1:] = b"\x01"  # a full-size, writable buffer
    assert buffer[-1] == 1 and len(buffer) == size


@pytest.mark.parametrize("size, alignment", [(0, 64), (-1, 64), (64, 0), (64, True), (2.0, 64)])
def test_an_aligned_buffer_of_no_size_or_alignment_is_refused(size: object, alignment: object) -> None:
    with pytest.raises(InvalidArgumentError):
        aligned_buffer(size, alignment)  # type: ignore[arg-type]


@pytest.mark.parametrize("length", [FMT.entry_length, 1, BUFFER_ALIGNMENT - 1])
def test_pooled_entry_buffers_are_cache_line_aligned(length: int) -> None:
    pool = EntryPool(length, max_free=4)
    buffers = [pool.take() for _ in range(4)]
    assert all(address_of(b) % BUFFER_ALIGNMENT == 0 and len(b) == length for b in buffers)
    for b in buffers:
        pool.give(b)
    assert pool.free == 4 and all(any(t is b for b in buffers) for t in [pool.take() for _ in range(4)])
    pool.give(bytearray(length))  # type: ignore[arg-type]  # not one of the pool's kind: not kept
    pool.give(memoryview(bytes(length)))  # read-only
    assert pool.free == 0


def test_dropped_entries_give_their_buffers_back_and_the_pool_stays_bounded() -> None:
    storage = GatedStorage()
    pool = EntryPool(16, max_free=2)
    writer = AsyncWriter(storage, max_pending=2, batch_size=1)
    try:
        buffers = [pool.take() for _ in range(6)]
        for i, buffer in enumerate(buffers):
            writer.submit([(f"k{i}", buffer)], pool=pool)  # never blocks: the queue drops its oldest
        assert writer.stats.dropped >= 3 and pool.free == 2  # dropped ones came back, up to the bound
        storage.gate.set()
        assert writer.flush(10.0)
        assert writer.stats.written + writer.stats.dropped == 6 and pool.free == 2
        with pytest.raises(InvalidArgumentError):
            writer.submit([("k9", bytes(16))], pool=pool)  # only the pool's own buffers go in uncopied
    finally:
        storage.gate.set()
        writer.close(5.0)


# ------------------------------------------------------------------ a tier that only looks up


def writer_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "kvblocks-storage-writer")


def test_a_tier_that_never_saves_runs_no_writer_thread(tmp_path: Path) -> None:
    before = writer_threads()
    tier = tier_on(FileStorage(tmp_path), writer_on_demand=True)
    assert writer_threads() == before and tier.flush(0.0)  # nothing to wait for
    tier.save_built([b"\x01" * 16], lambda i, out: out.__setitem__(slice(None), bytes(256)))
    assert writer_threads() == before + 1 and tier.flush(10.0) and tier.known_hashes() == [b"\x01" * 16]
    tier.close()
    idle = tier_on(FileStorage(tmp_path), writer_on_demand=True)
    idle.close()
    with pytest.raises(SequenceStateError):  # as before: a closed tier takes no saves
        idle.save([b"\x02" * 16], [bytes(256)])
    assert idle.writer.closed
    eager = tier_on(FileStorage(tmp_path))  # the default: the writer starts with the tier
    assert writer_threads() == before + 1
    eager.close()
    assert writer_threads() == before


def test_a_store_opened_without_indexing_still_serves_what_is_on_disk(tmp_path: Path) -> None:
    writer = FileStorage(tmp_path)
    writer.put([(KEY, FMT.encode(bytes(256), KEY))])
    (tmp_path / writer._shard(KEY) / ".tmp-left-by-a-dead-writer").write_bytes(b"x")
    lookup = FileStorage(tmp_path, index_existing=False)
    assert len(lookup) == 0 and lookup.exists([KEY, OTHER_KEY]) == [True, False] and lookup.contains([KEY]) == 1
    assert (tmp_path / writer._shard(KEY) / ".tmp-left-by-a-dead-writer").exists()  # not its to clean
    assert FileStorage(tmp_path).exists([KEY]) == [True]


@pytest.mark.parametrize("version_byte", [0, 2, 4, 0xFF])
def test_a_flipped_version_byte_is_removed_and_the_block_written_again(tmp_path: Path, version_byte: int) -> None:
    """Under a key whose format tag names this format, a header of another version is damage: read_into counts it
    corrupt and removes it, so the writer (which skips keys that exist) stores the rightful entry again."""
    tier = StorageTier(TierConfig(storage=FileStorage(tmp_path), entry_format=FMT), "ns", "xxh3-128", 4)
    try:
        h = b"\x05" * 16
        (key,) = tier.keys_of(h)
        sound = FMT.encode(bytes(range(256)), key)
        damaged_entry = sound[:8] + bytes([version_byte]) + sound[9:]
        tier.backend.put([(key, damaged_entry)])
        assert tier.read_into([h], [[bytearray(256)]]) == 0
        assert tier.stats.loads_corrupt == 1 and tier.backend.get([key]) == [None]
        tier.save([h], [bytes(range(256))])
        assert tier.flush(5.0) and tier.writer.stats.written == 1
        target = bytearray(256)
        assert tier.read_into([h], [[target]]) == 1 and bytes(target) == bytes(range(256))
    finally:
        tier.close()
