"""The worker's hot paths (kvblocks.integrations.vllm.transfer): load_run reads entries straight into the
KV blocks, save_run builds entries in place. Oracles: the payload by its definition (every layer's block
bytes in layer order), EntryFormat.encode / decode, and the staged torch path (LayerBlocks.read/write)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kvblocks.errors import InvalidArgumentError  # noqa: E402
from kvblocks.integrations.vllm.block_copy import LayerBlocks  # noqa: E402
from kvblocks.integrations.vllm.transfer import load_run, save_run  # noqa: E402
from kvblocks.tiers import FileStorage, MemoryStorage  # noqa: E402
from kvblocks.tiers.storage_tier import StorageTier  # noqa: E402
from tests.support.damage import damaged  # noqa: E402
from tests.support.vllm_transfer import FMT, HASHES, NUM_BLOCKS, kv, payload_of, staged, tier_on  # noqa: E402


@pytest.fixture
def tier(tmp_path: Path):  # type: ignore[no-untyped-def]
    made = tier_on(FileStorage(tmp_path))
    yield made
    made.close()


@pytest.mark.parametrize("path", ["host", "staged"])
def test_blocks_saved_in_place_load_back_byte_for_byte(tier: StorageTier, path: str) -> None:
    source = kv(1)
    saving = LayerBlocks(source) if path == "host" else staged(LayerBlocks(source))
    save_run(tier, saving, HASHES, [6, 1, 3, 1])
    assert tier.flush(10.0)
    expected = [payload_of(source, b) for b in (6, 1, 3, 1)]
    for h, payload in zip(HASHES, expected, strict=True):
        (key,) = tier.keys_of(h)
        assert tier.backend.get([key])[0] == FMT.entry_format.encode(payload, key)  # entry format unchanged
    target = kv(2)
    loading = LayerBlocks(target) if path == "host" else staged(LayerBlocks(target))
    assert load_run(tier, loading, HASHES, [0, 2, 4, 7]) == 4
    assert [payload_of(target, b) for b in (0, 2, 4, 7)] == expected
    assert payload_of(target, 5) == payload_of(kv(2), 5)  # blocks not named are untouched


def test_a_backend_that_cannot_read_into_place_loads_the_same() -> None:
    tier = tier_on(MemoryStorage())
    try:
        source, target = kv(3), kv(4)
        save_run(tier, LayerBlocks(source), HASHES[:2], [2, 5])
        assert tier.flush(10.0)
        assert load_run(tier, LayerBlocks(target), HASHES[:2], [1, 0]) == 2
        assert [payload_of(target, b) for b in (1, 0)] == [payload_of(source, b) for b in (2, 5)]
    finally:
        tier.close()


def test_bad_block_ids_raise_before_anything_is_queued_or_read(tier: StorageTier) -> None:
    blocks = LayerBlocks(kv(5))
    for bad in ([0, NUM_BLOCKS], [True, 1], [0]):  # out of range, a bool, one id short
        with pytest.raises(InvalidArgumentError):
            save_run(tier, blocks, HASHES[:2], bad)
        with pytest.raises(InvalidArgumentError):
            load_run(tier, blocks, HASHES[:2], bad)
    assert tier.writer.stats.submitted == 0 and tier.stats.loads_requested == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_entry_is_a_counted_miss_and_the_rest_of_the_run_a_load_error(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Whatever bytes a file holds: no exception, the run stops before the damaged block, the damage is
    counted, and the good blocks before it hold exactly their KV (the connector reports the rest)."""
    tier = tier_on(FileStorage(tmp_path_factory.mktemp("fuzz")))
    try:
        source, target = kv(6), kv(7)
        save_run(tier, LayerBlocks(source), HASHES, [0, 1, 2, 3])
        assert tier.flush(10.0)
        bad = data.draw(st.integers(0, 3))
        (key,) = tier.keys_of(HASHES[bad])
        path = Path(tier.backend._file(key))  # type: ignore[attr-defined]
        raw = path.read_bytes()
        broken = damaged(raw, data)
        path.write_bytes(broken)
        usable = load_run(tier, LayerBlocks(target), HASHES, [4, 5, 6, 7])
        if FMT.entry_format.decode(broken, key)[0] is not None:  # a damage that left the entry sound (rare)
            assert usable == 4
            return
        assert usable == bad
        assert [payload_of(target, b) for b in (4, 5, 6, 7)[:bad]] == [payload_of(source, b) for b in range(bad)]
        stats = tier.stats
        assert stats.loads_hit == bad and stats.loads_corrupt + stats.loads_wrong_key == 1
        assert HASHES[bad] not in tier.known_hashes()
    finally:
        tier.close()


def test_a_missing_entry_in_the_middle(tier: StorageTier) -> None:
    save_run(tier, LayerBlocks(kv(8)), HASHES, [0, 1, 2, 3])
    assert tier.flush(10.0)
    (key,) = tier.keys_of(HASHES[1])
    os.unlink(tier.backend._file(key))  # type: ignore[attr-defined]
    assert load_run(tier, LayerBlocks(kv(9)), HASHES, [4, 5, 6, 7]) == 1
    assert tier.stats.loads_missing == 1 and tier.stats.loads_beyond_a_miss == 2
