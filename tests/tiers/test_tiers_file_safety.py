"""FileStorage in a directory others can write: odd things at entry paths never block a reader, never lead
it outside the root, and cost a counted miss; the start-up scan never follows a link nor fails; the byte
count stays true when a delete races a read; an unwritable directory is refused and failed writes are
logged (issue 30, items 3, 4, 6 and 8)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvblocks.errors import ConfigError
from kvblocks.hashing import Namespace
from kvblocks.integrations.vllm.settings import ConnectorSettings
from kvblocks.tiers import FileStorage, file_storage
from kvblocks.tiers.config import TierConfig
from kvblocks.tiers.entry import EntryFormat
from kvblocks.tiers.storage_tier import StorageTier

FMT = EntryFormat("xxh3-128", "float16", (2, 2, 4, 8), 7, 256)
HASH = b"\x07" * 16
PAYLOAD = bytes(range(256))
SECONDS = 5.0  # far more than any of these calls needs; a reader stuck in open() never returns


def key(name: str) -> str:
    return f"xxh3-128.{'0' * 16}.b{name}"


def bounded(call: Callable[[], Any], unblock: Callable[[], None] = lambda: None) -> Any:
    """``call()``'s result, run on a thread so that a call that blocks fails the test instead of hanging the
    suite (``unblock`` then releases the thread)."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = call()
        except BaseException as error:  # handed to the test below
            result["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(SECONDS)
    if thread.is_alive():
        unblock()
        thread.join(SECONDS)
        pytest.fail(f"the call did not return within {SECONDS} s: blocked")
    if "error" in result:
        raise result["error"]
    return result["value"]


def open_for_writing(fifo: str) -> None:
    """Release a reader blocked opening ``fifo`` (then, seeing no data, it reads the end)."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def tier_on(storage: FileStorage) -> StorageTier:
    return StorageTier(TierConfig(storage=storage, entry_format=FMT), Namespace("m"), "xxh3-128", 16)


def make_socket(path: str) -> None:
    """A Unix socket file at ``path`` (bound at a short name, then moved: socket names are 108 bytes at most)."""
    short = os.path.join(tempfile.gettempdir(), f"kvs-{uuid.uuid4().hex[:12]}")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(short)
    os.rename(short, path)


def plant(kind: str, path: str, outside: Path, entry: bytes) -> None:
    """Put a ``kind`` of odd thing at ``path``: a FIFO, a link to a sound entry elsewhere, a directory, a socket."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        target = outside / "entry"
        target.write_bytes(entry)
        os.symlink(target, path)
    elif kind == "directory":
        os.mkdir(path)
    else:
        make_socket(path)


ODD = ["fifo", "link", "directory", "socket"]


# ---------------------------------------------------------------- item 3: odd things at an entry's path


@pytest.mark.parametrize("kind", ODD)
@pytest.mark.parametrize("op", ["get", "get_into", "read", "read_into"])
def test_an_odd_thing_at_an_entry_path_is_a_quick_counted_miss(kind: str, op: str, tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "kv")
    tier = tier_on(storage)
    try:
        (k,) = tier.keys_of(HASH)
        path = storage._file(k)
        outside = tmp_path / "outside"
        outside.mkdir()
        plant(kind, path, outside, FMT.encode(PAYLOAD, k))  # a link leads to a sound entry: still not read
        calls: dict[str, Callable[[], Any]] = {
            "get": lambda: storage.get([k]),
            "get_into": lambda: storage.get_into(k, [bytearray(FMT.entry_length)]),
            "read": lambda: tier.read([HASH]).payloads,
            "read_into": lambda: tier.read_into([HASH], [[bytearray(FMT.payload_length)]]),
        }
        answer = bounded(calls[op], lambda: open_for_writing(path))
        assert answer in ([None], None, (), [], 0)  # a miss, in each call's own words
        stats = storage.stats
        assert (stats.gets, stats.misses, stats.hits, stats.get_errors, stats.skipped_entries) == (1, 1, 0, 1, 1)
        assert bounded(lambda: storage.exists([k])) == [False] and bounded(lambda: storage.contains([k])) == 0
        assert len(storage) == 0 and storage.nbytes == 0
        assert os.path.lexists(path)  # not removed either: it is not kvblocks' to remove
    finally:
        tier.close()


def test_a_shard_that_is_a_link_is_not_entered(tmp_path: Path) -> None:
    """A shard directory replaced by a link to a directory elsewhere: nothing is read, written or deleted
    through it."""
    root = tmp_path / "kv"
    storage = FileStorage(root)
    k = key("0a")
    shard = Path(storage._file(k)).parent
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / k).write_bytes(b"theirs")
    shard.symlink_to(elsewhere)
    assert storage.get([k]) == [None] and storage.get_into(k, [bytearray(6)]) is None
    assert storage.exists([k]) == [False] and storage.contains([k]) == 0
    assert storage.delete([k]) == 0
    assert storage.put([(k, b"mine")]) == 0 and storage.stats.put_errors == 1
    assert (elsewhere / k).read_bytes() == b"theirs" and sorted(os.listdir(elsewhere)) == [k]
    assert storage.stats.skipped_entries == 2  # the two reads that met it


def test_a_link_planted_at_the_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "kv")
    k = key("0a")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    directory = Path(storage._file(k)).parent
    directory.mkdir()
    (directory / f".tmp-{k}-{os.getpid()}-1").symlink_to(victim)  # the name the next write will use
    assert storage.put([(k, b"value")]) == 0 and storage.stats.put_errors == 1
    assert victim.read_bytes() == b"precious"
    assert storage.put([(k, b"value")]) == 1 and storage.get([k]) == [b"value"]  # the next name is free


# ---------------------------------------------------------------- item 4: the start-up scan


def test_start_up_never_deletes_through_a_link_nor_fails_on_odd_entries(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    first = FileStorage(root)
    good = key("0a")
    first.put([(good, b"sound")])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ".tmp-theirs-1-1").write_bytes(b"keep me")  # a .tmp-* file someone else owns
    (outside / key("0b")).write_bytes(b"not ours")
    shard_of_good = Path(first._file(good)).parent.name
    link_shard = next(f"{i:02x}" for i in range(256) if f"{i:02x}" != shard_of_good)
    (root / link_shard).symlink_to(outside, target_is_directory=True)  # a shard replaced by a link
    shard = root / shard_of_good
    (shard / ".tmp-dir-1-1").mkdir()  # a "temporary" that is a directory
    (shard / ".tmp-link-1-1").symlink_to(outside / ".tmp-theirs-1-1")  # a temporary that is a link
    os.mkfifo(shard / key("0c"))
    (shard / "NOT-A-KEY").write_bytes(b"x")
    (shard / ".tmp-dead-1-1").write_bytes(b"half")  # a write that died: still cleaned up
    second = bounded(lambda: FileStorage(root))
    assert (outside / ".tmp-theirs-1-1").read_bytes() == b"keep me" and (outside / key("0b")).exists()
    assert not (shard / ".tmp-dead-1-1").exists()
    assert (shard / ".tmp-dir-1-1").is_dir() and (shard / ".tmp-link-1-1").is_symlink()
    assert len(second) == 1 and second.nbytes == 5 and second.get([good]) == [b"sound"]
    assert second.stats.skipped_entries == 5  # the link shard, the directory, the link, the FIFO, NOT-A-KEY


NAMES = st.sampled_from([key("0a"), key("0b"), key("0c"), ".tmp-a-1-1", ".tmp-b-2-2", "junk"])
KINDS = st.sampled_from(["file", "fifo", "dir", "link-file", "link-dir", "socket"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    things=st.lists(st.tuples(st.sampled_from(["00", "3f", "ff", "zz"]), NAMES, KINDS), max_size=12),
    shard_links=st.lists(st.sampled_from(["00", "3f", "ff"]), max_size=2),
)
def test_start_up_over_any_mix_of_odd_entries(tmp_path_factory: pytest.TempPathFactory, things, shard_links) -> None:
    """Whatever the directory holds: the scan returns, touches nothing outside the root, removes only regular
    ``.tmp-*`` files, indexes exactly the regular files named as a key, and counts every other thing."""
    base = tmp_path_factory.mktemp("scan")
    root, outside = base / "kv", base / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / ".tmp-a-1-1").write_bytes(b"outside")
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    expect_index: set[str] = set()
    expect_skipped = 0
    expect_removed: set[Path] = set()
    links = set(shard_links)
    for shard in links:
        (root / shard).symlink_to(outside, target_is_directory=True)
    expect_skipped += len(links)
    made: set[Path] = set()
    for shard, name, kind in things:
        if shard in links:
            continue
        path = root / shard / name
        if path in made:
            continue
        made.add(path)
        path.parent.mkdir(exist_ok=True)
        if kind == "file":
            path.write_bytes(b"v" * 3)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "dir":
            path.mkdir()
        elif kind == "link-file":
            path.symlink_to(outside / ".tmp-a-1-1")
        elif kind == "link-dir":
            path.symlink_to(outside, target_is_directory=True)
        else:
            make_socket(str(path))
        if shard == "zz":
            continue  # not a shard name: not kvblocks', not looked at
        if kind != "file":
            expect_skipped += 1
        elif name.startswith(".tmp-"):
            expect_removed.add(path)
        elif name != "junk" and FileStorage._shard(name) == shard:
            expect_index.add(name)
        else:
            expect_skipped += 1  # not a key, or a key in another shard than its own
    storage = bounded(lambda: FileStorage(root))
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    assert set(storage._index) == expect_index and storage.nbytes == 3 * len(expect_index)
    assert storage.stats.skipped_entries == expect_skipped
    assert all(not p.exists() for p in expect_removed)
    assert all(os.path.lexists(p) for p in made - expect_removed)


# ---------------------------------------------------------------- item 6: the byte count under a racing delete


def test_a_delete_during_a_read_leaves_no_bytes_counted(tmp_path: Path) -> None:
    """Another thread deletes an entry while it is being read (here: from inside the read's ``on_read``,
    the point where the read holds no lock); the hit must not index it again."""
    writer, reader = FileStorage(tmp_path), FileStorage(tmp_path)  # the entry comes from another process
    k = key("0a")
    writer.put([(k, b"x" * 100)])
    buffer = bytearray(100)
    assert reader.get_into(k, [buffer], on_read=lambda run: reader.delete([k])) == 100
    assert (len(reader), reader.nbytes) == (0, 0)


class SharedDirectory(RuleBasedStateMachine):
    """One FileStorage (with a byte budget) and another process's writes to its directory; deletes from
    another thread land in the middle of reads. Whatever the order, the index holds only entries on disk,
    with their sizes, the byte count is their sum, and a put leaves it within the budget."""

    KEYS: ClassVar[list[str]] = [key(f"{i:02x}") for i in range(6)]

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="kvblocks-race-")
        self.storage = FileStorage(self.tmp, byte_budget=400)
        self.other = FileStorage(self.tmp, index_existing=False)  # another process's writes

    def teardown(self) -> None:
        self.storage.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    @rule(k=st.sampled_from(KEYS), size=st.integers(1, 150))
    def put(self, k: str, size: int) -> None:
        self.storage.put([(k, b"p" * size)])
        assert self.storage.nbytes <= 400  # a put enforces the budget (a read of another's entry may pass it)

    @rule(k=st.sampled_from(KEYS), size=st.integers(1, 150))
    def other_process_writes_a_new_entry(self, k: str, size: int) -> None:
        if not self.storage.exists([k])[0]:  # an overwrite of a known entry would change its size unseen
            self.other.put([(k, b"o" * size)])

    @rule(k=st.sampled_from(KEYS))
    def get(self, k: str) -> None:
        self.storage.get([k])

    @rule(k=st.sampled_from(KEYS))
    def get_into(self, k: str) -> None:
        self.storage.get_into(k, [bytearray(150)])

    @rule(k=st.sampled_from(KEYS))
    def get_into_while_another_thread_deletes_it(self, k: str) -> None:
        path = self.storage._file(k)
        size = os.path.getsize(path) if os.path.isfile(path) else 1  # on_read sees only buffers filled whole
        self.storage.get_into(k, [bytearray(size)], on_read=lambda run: self.storage.delete([k]))

    @rule(k=st.sampled_from(KEYS))
    def get_while_another_thread_deletes_it(self, k: str) -> None:
        real_read = os.read

        def read_then_delete(fd: int, n: int) -> bytes:
            data = real_read(fd, n)
            self.storage.delete([k])
            return data

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "read", read_then_delete)
            self.storage.get([k])

    @rule(k=st.sampled_from(KEYS))
    def delete(self, k: str) -> None:
        self.storage.delete([k])

    @invariant()
    def index_matches_the_disk(self) -> None:
        index = dict(self.storage._index)
        for k, size in index.items():
            path = self.storage._file(k)
            assert os.path.isfile(path) and os.path.getsize(path) == size, k
        assert self.storage.nbytes == sum(index.values())


def test_the_byte_count_holds_under_racing_deletes() -> None:
    SharedDirectory.TestCase.settings = settings(
        max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
    )
    SharedDirectory.TestCase().runTest()


# ---------------------------------------------------------------- item 8: unwritable directories, failed writes


def fail_writes_in(monkeypatch: pytest.MonkeyPatch, directory: Path, error: int = errno.EACCES) -> None:
    """Every file created under ``directory`` fails with ``error``, as on a read-only mount or a directory of
    another owner (the tests run as root, whom permissions do not stop)."""
    real_open = open

    def failing_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if set(mode) & set("wxa") and str(file).startswith(str(directory)):
            raise OSError(error, os.strerror(error), str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(file_storage, "open", failing_open, raising=False)


@pytest.mark.parametrize("error", [errno.EACCES, errno.EROFS])
def test_a_directory_that_cannot_be_written_is_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    fail_writes_in(monkeypatch, root, error)
    with pytest.raises(ConfigError, match=f"storage directory {root} is not writable"):
        FileStorage(root)
    FileStorage(root, check_writable=False)  # a process that only looks up: fine
    assert os.listdir(root) == []  # the probe left nothing


def test_the_connector_refuses_an_unwritable_directory_only_where_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fail_writes_in(monkeypatch, tmp_path)
    settings_ = ConnectorSettings(path=str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path))):
        settings_.open_storage()  # the worker half: it saves
    assert isinstance(settings_.open_storage(writes=False), FileStorage)  # the scheduler half never writes


def test_a_real_read_only_directory_is_refused(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into any directory: the permission case is simulated above")
    root = tmp_path / "kv"
    root.mkdir(mode=0o555)
    try:
        with pytest.raises(ConfigError, match="not writable"):
            FileStorage(root)
    finally:
        root.chmod(0o755)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_failed_writes_are_logged_rate_limited_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(file_storage, "time", clock)
    storage = FileStorage(tmp_path)
    fail_writes_in(monkeypatch, tmp_path, errno.ENOSPC)
    caplog.set_level(logging.WARNING, logger="kvblocks.tiers")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "kvblocks.tiers"]

    storage.put([(key("0a"), b"x"), (key("0b"), b"y"), (key("0c"), b"z")])
    assert storage.stats.put_errors == 3
    (first,) = warnings()  # the first at once, the next two quiet
    assert key("0a") in first and str(tmp_path) in first and "No space left" in first and "1 failed write " in first
    clock.now += file_storage.WARN_INTERVAL_S - 1
    storage.put([(key("0d"), b"w")])
    assert len(warnings()) == 1
    clock.now += 1
    storage.put([(key("0e"), b"v")])
    assert len(warnings()) == 2 and "4 failed writes since the last warning" in warnings()[1]
    assert storage.stats.put_errors == 5
