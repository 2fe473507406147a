"""Storage identity (issue 16.5): keys carry the KV format, headers carry the key they were written under.

Two deployments of one model whose KV formats differ (float16 vs bfloat16) share a storage tier:
each must write, find and load its own entries only. An entry copied under another key is a
counted miss, never served.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks.backends import KVCacheSpec
from kvblocks.tiers import (
    EntryFormat,
    FileStorage,
    MemoryStorage,
    StorageTier,
    TierConfig,
    TieredKVCacheManager,
    block_key,
    namespace_tag,
)
from kvblocks.tiers.entry import HEADER
from kvblocks.tiers.storage import StorageBackend
from tests.support.tier_sim import SimEngine, content_of

B = 4
A = list(range(17))  # 4 full blocks + 1 token


def fmt(dtype: str) -> EntryFormat:
    """16-byte blocks (the simulated engine's payload size) of a one-layer model in ``dtype``."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=dtype, block_size=B)
    return EntryFormat.for_spec(spec, "xxh3-128")


F16, BF16 = fmt("float16"), fmt("bfloat16")


@pytest.fixture
def managers() -> Iterator[list[TieredKVCacheManager]]:
    made: list[TieredKVCacheManager] = []
    yield made
    for m in made:
        m.close(timeout=1)


@pytest.fixture(params=["memory", "file"])
def open_storage(request, tmp_path: Path) -> Callable[[], StorageBackend]:
    """Opens the shared store: the same MemoryStorage every time, or a fresh FileStorage on one directory."""
    shared = MemoryStorage()
    return (lambda: shared) if request.param == "memory" else (lambda: FileStorage(tmp_path / "kv"))


def node(managers: list[TieredKVCacheManager], storage: StorageBackend, entry_format: EntryFormat):
    config = TierConfig(storage=storage, entry_format=entry_format, storage_policy="write-through")
    m = TieredKVCacheManager(8, B, tiers=config)
    managers.append(m)
    return m


def serve(m: TieredKVCacheManager, seq: str) -> tuple[int, int]:
    """Run prompt ``A`` to the end; returns (tokens lookup promised from storage, tokens loaded)."""
    counts, _ = serve_and_hash(m, seq)
    return counts


def serve_and_hash(m: TieredKVCacheManager, seq: str) -> tuple[tuple[int, int], tuple[object, ...]]:
    """:func:`serve`, and the prompt's block hashes."""
    sim = SimEngine(m, settle=True)
    m.add_sequence(seq, A)
    assert m.storage is not None and m.storage.wait_idle(5)  # the probe from add_sequence
    promised = m.lookup(seq).storage
    assert m.allocate(seq, len(A) - m.lookup(seq).total) is not None
    sim.wait_ready(seq)
    loaded = m.num_computed_tokens(seq)
    if len(m.block_table(seq)) * B < len(A):  # a short read: the rest is recomputed
        assert m.allocate(seq, len(A) - loaded) is not None
        sim.step()
    sim.check_sequence(seq)  # loaded blocks hold their own KV
    sim.compute(seq, len(A))
    m.commit(seq, len(A))
    hashes = m.block_hashes(seq)
    sim.run_plan()
    m.free(seq)
    sim.run_plan()
    assert m.flush(5)
    return (promised, loaded), hashes


def test_float16_and_bfloat16_nodes_never_see_each_others_entries(managers, open_storage) -> None:
    assert F16.payload_length == BF16.payload_length and F16.tag != BF16.tag
    f16, bf16 = node(managers, open_storage(), F16), node(managers, open_storage(), BF16)
    assert serve(f16, "a") == (0, 0)
    assert serve(bf16, "a") == (0, 0)  # before: lookup promised 16 tokens of f16's entries
    for m in (f16, bf16):
        assert m.storage is not None
        writer, reads = m.storage.writer.stats, m.tier_stats.storage
        assert (writer.written, writer.skipped_existing) == (4, 0)  # before: bf16 skipped all 4 (keys existed)
        assert (reads.loads_corrupt, reads.loads_wrong_key) == (0, 0)
    for entry_format in (F16, BF16):  # restarted nodes find their own entries, and only those
        m = node(managers, open_storage(), entry_format)
        assert serve(m, "b") == (16, 16)
        stats = m.tier_stats.storage
        assert (stats.loads_hit, stats.loads_corrupt, stats.loads_wrong_key) == (4, 0, 0)
        assert m.storage is not None and m.storage.writer.stats.written == 0  # nothing new to write


def test_an_entry_copied_under_another_key_is_a_counted_miss_and_removed(managers, open_storage) -> None:
    writer = node(managers, open_storage(), F16)
    _, hashes = serve_and_hash(writer, "a")
    assert writer.storage is not None
    keys = [writer.storage.keys_of(h)[0] for h in hashes]  # type: ignore[arg-type]
    backend = open_storage()
    (first,) = backend.get([keys[0]])
    assert backend.delete([keys[1]]) == 1 and backend.put([(keys[1], first)]) == 1  # block 0's entry as block 1's
    reader = node(managers, backend, F16)
    assert serve(reader, "b") == (16, 4)  # only block 0 is served; the rest is recomputed
    stats = reader.tier_stats.storage
    assert (stats.loads_hit, stats.loads_wrong_key, stats.loads_corrupt) == (1, 1, 0)
    assert reader.storage is not None and reader.storage.writer.stats.written == 1  # the rightful entry again
    (value,) = backend.get([keys[1]])
    assert value != first and F16.decode(value, keys[1])[1] == ""


def _version_1_entry(entry_format: EntryFormat, payload: bytes) -> bytes:
    """An entry as format version 1 wrote it: a 100-byte header without the key digest."""
    dims = list(entry_format.shape) + [0] * (8 - len(entry_format.shape))
    v1 = struct.Struct("<8sHH16s16s8IQQQ")
    text = [f.encode().ljust(16, b"\0") for f in (entry_format.scheme, entry_format.dtype)]
    header = v1.pack(b"KVBENTRY", 1, len(entry_format.shape), *text, *dims, entry_format.fingerprint, len(payload), 0)
    return header + payload


def test_an_old_version_entry_under_a_new_key_is_corrupt_and_removed() -> None:
    """The key's format tag names format version 3: nothing sound of another version is ever stored under it, so
    such a header is damage (a flipped version byte), removed so that the block can be written again."""
    backend = MemoryStorage()
    tier = StorageTier(TierConfig(storage=backend, entry_format=F16), "ns", "xxh3-128", B)
    try:
        h = b"\x07" * 16
        (key,) = tier.keys_of(h)
        old = _version_1_entry(F16, content_of(h))
        assert F16.decode(old, key) == (None, "other format version")
        backend.put([(key, old)])
        tier.load([h])
        assert tier.wait_idle(5)
        ((_, outcome),) = tier.take_results()
        assert outcome.payloads == () and tier.stats.loads_corrupt == 1 and tier.stats.load_errors == 0
        assert len(backend) == 0
    finally:
        tier.close()


def test_keys_name_the_format_and_compose_with_namespace_and_group_tags() -> None:
    tag = namespace_tag("llama", "xxh3-128", B)
    k16 = block_key(tag, "xxh3-128", b"\x12\x34", rank=1, format_tag=F16.tag)
    assert k16 == f"xxh3-128.{tag}.{F16.tag}.b1234.r1"
    assert k16 != block_key(tag, "xxh3-128", b"\x12\x34", rank=1, format_tag=BF16.tag)
    same_bytes = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float16", block_size=B, block_major=False)
    assert EntryFormat.for_spec(same_bytes, "xxh3-128").tag == F16.tag  # an arrangement with the same bytes


# ---------------------------------------------------------------- fuzz: the key digest and the format tag

KEYS = st.from_regex(r"[a-z0-9][a-z0-9.\-]{0,40}", fullmatch=True)
FORMATS = st.builds(
    EntryFormat,
    st.sampled_from(["xxh3-128", "sha256", "xxh3-64-1337"]),
    st.sampled_from(["float16", "bfloat16", "float8_e4m3fn", "uint8"]),
    st.lists(st.integers(1, 64), min_size=1, max_size=8).map(tuple),
    st.integers(0, 2**64 - 1),
    st.integers(0, 64),
)


@settings(max_examples=1500, deadline=None)
@given(FORMATS, KEYS, KEYS, st.data())
def test_an_entry_decodes_only_under_its_own_key(entry_format: EntryFormat, key: str, other: str, data) -> None:
    payload = data.draw(st.binary(min_size=entry_format.payload_length, max_size=entry_format.payload_length))
    entry = entry_format.encode(payload, key)
    assert len(entry) == HEADER.size + len(payload)
    assert entry_format.decode(entry, key) == (payload, "")
    assert entry_format.decode(entry, other) == ((payload, "") if other == key else (None, "written under another key"))
    assert entry_format.decode(entry_format.encode(payload), key) == (None, "written under another key")  # unbound


@settings(max_examples=1500, deadline=None)
@given(FORMATS, FORMATS)
def test_formats_share_a_tag_only_if_their_headers_agree(a: EntryFormat, b: EntryFormat) -> None:
    assert len(a.tag) == 16 and set(a.tag) <= set("0123456789abcdef")
    assert (a.tag == b.tag) == (a == b)  # xxh3-64 collisions aside
    if a != b and a.payload_length == b.payload_length:
        assert b.decode(a.encode(bytes(a.payload_length), "k"), "k")[1] == "other scheme, dtype, shape or spec"
