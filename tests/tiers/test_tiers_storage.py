"""Storage entries, keys, and the memory and file backends (issue 4, the storage layer)."""

from __future__ import annotations

import errno
import os
import struct

import pytest

from kvblocks.backends import KVCacheSpec
from kvblocks.errors import ConfigError, InvalidArgumentError, InvalidBlockHashError
from kvblocks.tiers import (
    EntryFormat,
    FileStorage,
    MemoryStorage,
    StorageBackend,
    block_key,
    namespace_tag,
    usable_prefix,
)
from kvblocks.tiers.entry import FORMAT_VERSION, HEADER
from tests.support.storage import FORMAT, PAYLOAD, SPEC, keys

# ---------------------------------------------------------------- entries


def test_entry_round_trip_and_header_size() -> None:
    assert HEADER.size == 128  # padded: the payload starts on a cache line of the file
    entry = FORMAT.encode(PAYLOAD, "k.1")
    assert len(entry) == 128 + SPEC.bytes_per_block and entry[92:112] == bytes(20)
    payload, why = FORMAT.decode(entry, "k.1")
    assert why == "" and bytes(payload) == PAYLOAD
    assert FORMAT.shape == (2, 2, 4, 2, 8) and FORMAT.dtype == "bfloat16"


def _flip(entry: bytes, at: int) -> bytes:
    return entry[:at] + bytes([entry[at] ^ 0xFF]) + entry[at + 1 :]


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda e: None, "absent"),
        (lambda e: e[:50], "truncated header"),
        (lambda e: e[:-1], "truncated payload"),
        (lambda e: e + b"x", "overlong payload"),
        (lambda e: _flip(e, 0), "bad magic"),
        (lambda e: e[:8] + struct.pack("<H", 1) + e[10:], "other format version"),
        (lambda e: e[:8] + struct.pack("<H", 1) + e[10:100], "other format version"),  # a version-1-sized value
        (lambda e: e[:8] + struct.pack("<H", 2) + e[10:92] + e[112:], "other format version"),  # version 2: 108 bytes
        (lambda e: e[:8] + struct.pack("<H", FORMAT_VERSION + 1) + e[10:], "other format version"),
        (lambda e: _flip(e, 20), "other scheme, dtype, shape or spec"),
        (lambda e: _flip(e, 100), "other scheme, dtype, shape or spec"),  # the padding must be zeros
        (lambda e: _flip(e, len(e) - 1), "checksum mismatch"),
        (lambda e: _flip(e, HEADER.size - 1), "checksum mismatch"),
        (lambda e: _flip(e, HEADER.size - 9), "written under another key"),  # the key digest
    ],
)
def test_damaged_entries_are_misses_with_a_reason(damage, reason: str) -> None:
    payload, why = FORMAT.decode(damage(FORMAT.encode(PAYLOAD, "k.1")), "k.1")
    assert payload is None and why == reason


def test_entries_of_another_spec_or_scheme_never_decode() -> None:
    entry = FORMAT.encode(PAYLOAD)
    for other in (
        EntryFormat.for_spec(SPEC, "sha256"),
        EntryFormat.for_spec(
            KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_size=4, layout="HND"),
            "xxh3-128",
        ),
        EntryFormat.for_spec(
            KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_size=4), "xxh3-128"
        ),
    ):
        assert other.decode(entry) == (None, "other scheme, dtype, shape or spec")
    arranged = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_size=4, block_major=False)
    assert EntryFormat.for_spec(arranged, "xxh3-128").decode(entry)[1] == ""  # same payload bytes either way


def test_encode_refuses_a_payload_of_the_wrong_length() -> None:
    with pytest.raises(ConfigError, match="payload is 3 bytes"):
        FORMAT.encode(b"abc")
    with pytest.raises(ConfigError, match="16-byte"):
        EntryFormat("a-scheme-name-that-is-too-long", "bfloat16", (1,), 0, 1)


# ---------------------------------------------------------------- keys


def test_keys_name_scheme_namespace_hash_and_rank() -> None:
    tag = namespace_tag("llama", "xxh3-128", 16)
    assert len(tag) == 16 and tag == namespace_tag("llama", "xxh3-128", 16)
    assert (
        len(
            {
                tag,
                namespace_tag("qwen", "xxh3-128", 16),
                namespace_tag("llama", "sha256", 16),
                namespace_tag("llama", "xxh3-128", 32),
            }
        )
        == 4
    )
    fmt = FORMAT.tag
    assert block_key(tag, "xxh3-128", b"\x0a\xbc", format_tag=fmt) == f"xxh3-128.{tag}.{fmt}.b0abc"
    assert block_key(tag, "xxh3-64-1337", 2748, rank=3, format_tag=fmt) == f"xxh3-64-1337.{tag}.{fmt}.iabc.r3"
    assert block_key(tag, "xxh3-128", b"\xab\xc0", format_tag=fmt) != block_key(
        tag, "xxh3-128", 0xABC0, format_tag=fmt
    )  # bytes and ints apart


@pytest.mark.parametrize("bad", [b"", -1, 1.5, True, None, "abc"])
def test_bad_hashes_make_no_key(bad) -> None:
    with pytest.raises(InvalidBlockHashError):
        block_key("0" * 16, "xxh3-128", bad, format_tag=FORMAT.tag)


@pytest.mark.parametrize(
    "bad", ["", "0" * 15, "0" * 17, "ABCDEF0123456789", "0123456789abcde.", "0123456789abcdef\n", None, 7]
)
def test_a_malformed_format_tag_makes_no_key(bad) -> None:
    with pytest.raises(InvalidArgumentError, match="format_tag"):
        block_key("0" * 16, "xxh3-128", b"\x01", format_tag=bad)


@pytest.mark.parametrize(
    "key", ["../etc/passwd", "/abs", "UPPER", "", "a b", "a/b", ".hidden", "x" * 300, "abc\n", "a.b\n", "\nabc"]
)
def test_only_well_formed_keys_reach_a_backend(key: str, tmp_path) -> None:
    for storage in (MemoryStorage(), FileStorage(tmp_path)):
        with pytest.raises(InvalidArgumentError):
            storage.put([(key, b"v")])
        with pytest.raises(InvalidArgumentError):
            storage.get([key])
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_usable_prefix_is_the_shortest_rank() -> None:
    assert usable_prefix([3, 1, 2]) == 1 and usable_prefix([5]) == 5
    with pytest.raises(ConfigError):
        usable_prefix([])


# ---------------------------------------------------------------- both backends


@pytest.fixture(params=["memory", "file"])
def storage(request, tmp_path):
    backend = MemoryStorage() if request.param == "memory" else FileStorage(tmp_path / "kv")
    yield backend
    backend.close()


def test_put_get_contains_delete(storage) -> None:
    assert isinstance(storage, StorageBackend)
    k = keys("0a", "0b", "0c", "0d")
    assert storage.put([(k[0], b"A"), (k[2], b"C"), (k[3], b"D")]) == 3
    assert storage.get(k) == [b"A", None, b"C", b"D"]
    assert storage.contains(k) == 1  # prefix semantics: k1 is missing, so k2 and k3 do not count
    assert storage.contains(k[2:]) == 2
    assert storage.exists(k) == [True, False, True, True]
    assert storage.delete([k[0], k[1]]) == 1
    assert storage.contains(k) == 0
    stats = storage.stats
    assert (stats.puts, stats.gets, stats.hits, stats.misses, stats.deletes) == (3, 4, 3, 1, 1)
    assert storage.put([(k[2], b"C2")]) == 1 and storage.get([k[2]]) == [b"C2"]  # overwrite


def test_byte_budget_evicts_least_recently_used_first(tmp_path) -> None:
    for storage in (MemoryStorage(byte_budget=30), FileStorage(tmp_path, byte_budget=30)):
        a, b, c, d = keys("aa", "bb", "cc", "dd")
        storage.put([(a, b"1" * 10), (b, b"2" * 10), (c, b"3" * 10)])
        storage.get([a])  # a is now the most recently used
        storage.put([(d, b"4" * 10)])
        assert storage.get([a, b, c, d]) == [b"1" * 10, None, b"3" * 10, b"4" * 10]
        assert storage.stats.evictions == 1 and storage.nbytes == 30
        storage.put([(keys("ee")[0], b"5" * 31)])  # larger than the whole budget: refused, counted
        assert storage.stats.put_errors == 1 and storage.nbytes == 30


# ---------------------------------------------------------------- files


def test_file_layout_is_sharded_and_leaves_no_temporaries(tmp_path) -> None:
    storage = FileStorage(tmp_path)
    k = keys("01", "02", "03")
    storage.put([(key, key.encode()) for key in k])
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == sorted(k)
    assert all(len(p.parent.name) == 2 and p.parent.parent == tmp_path for p in files)


def test_a_failed_write_is_dropped_and_counted(tmp_path, monkeypatch) -> None:
    storage = FileStorage(tmp_path)
    good, bad = keys("0a", "0b")
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith(bad):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert storage.put([(bad, b"x"), (good, b"y")]) == 1
    assert storage.stats.put_errors == 1
    assert storage.get([bad, good]) == [None, b"y"]
    assert not [p for p in tmp_path.rglob(".tmp-*")]  # the half-written temporary is gone


def test_permission_denied_on_read_is_a_counted_miss(tmp_path, monkeypatch) -> None:
    storage = FileStorage(tmp_path)
    (k,) = keys("0a")
    storage.put([(k, b"v")])
    real_open = os.open

    def denying_open(path, *args, **kwargs):  # root reads any file: chmod cannot make one unreadable here
        if isinstance(path, str) and os.path.basename(path) == k:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denying_open)
    assert storage.get([k]) == [None] and storage.get_into(k, [bytearray(1)]) is None
    assert storage.stats.get_errors == 2 and storage.stats.misses == 2 and storage.stats.skipped_entries == 0
    assert storage.exists([k]) == [True]  # there, only unreadable: not forgotten


def test_a_corrupt_file_is_a_miss_and_can_be_removed(tmp_path) -> None:
    storage = FileStorage(tmp_path)
    (k,) = keys("0a")
    storage.put([(k, FORMAT.encode(PAYLOAD))])
    path = next(p for p in tmp_path.rglob(k))
    path.write_bytes(path.read_bytes()[:-7])  # truncated on disk
    entry = storage.get([k])[0]
    assert FORMAT.decode(entry) == (None, "truncated payload")
    assert storage.delete([k]) == 1 and storage.contains([k]) == 0


def test_a_restarted_storage_knows_its_files_and_cleans_temporaries(tmp_path) -> None:
    first = FileStorage(tmp_path)
    a, b = keys("0a", "0b")
    first.put([(a, b"1" * 10)])
    os.utime(first._file(a), ns=(1, 1))  # older
    first.put([(b, b"2" * 10)])
    (tmp_path / "00").mkdir(exist_ok=True)
    (tmp_path / "00" / ".tmp-dead-1-1").write_bytes(b"half")
    second = FileStorage(tmp_path, byte_budget=15)
    assert len(second) == 2 and second.nbytes == 20
    second.put([(keys("0c")[0], b"3")])  # over budget: the oldest file goes first
    assert second.get([a, b]) == [None, b"2" * 10]
    assert not list(tmp_path.rglob(".tmp-*"))


def test_two_processes_sharing_a_directory_see_each_others_entries(tmp_path) -> None:
    writer, reader = FileStorage(tmp_path), FileStorage(tmp_path)
    (k,) = keys("0a")
    writer.put([(k, b"shared")])
    assert reader.contains([k]) == 1 and reader.get([k]) == [b"shared"]
    assert len(reader) == 1


def test_bad_storage_configuration(tmp_path) -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError):
            MemoryStorage(byte_budget=bad)
        with pytest.raises(ConfigError):
            FileStorage(tmp_path, byte_budget=bad)
    with pytest.raises(ConfigError, match="fsync"):
        FileStorage(tmp_path, fsync=1)  # type: ignore[arg-type]
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="storage directory"):
        FileStorage(tmp_path / "file" / "sub")
