"""A pool too large for the machine is refused up front, naming what it needs and what there is (issue 30: 15).

``KVCacheManager(num_blocks=10**9, block_size=16)`` used to build its lists until the OOM killer ended the
process at 21 GB.
"""

from __future__ import annotations

import time

import pytest

import kvblocks.pool
from kvblocks import BlockPool, ConfigError, KVCacheManager
from kvblocks.hybrid import HybridKVCacheManager
from kvblocks.tiers import TierConfig, TieredKVCacheManager


def test_a_billion_blocks_are_refused_at_once_naming_the_need_and_what_is_available(monkeypatch) -> None:
    monkeypatch.setattr(kvblocks.pool, "_available_memory", lambda: 8 * 2**30)
    started = time.perf_counter()
    with pytest.raises(ConfigError) as refused:
        KVCacheManager(num_blocks=10**9, block_size=16)
    assert time.perf_counter() - started < 1  # refused, not attempted
    need = 10**9 * kvblocks.pool.BYTES_PER_BLOCK / 2**30
    assert str(refused.value) == (
        f"num_blocks=1,000,000,000 needs about {need:,.1f} GiB of memory for its bookkeeping "
        f"({kvblocks.pool.BYTES_PER_BLOCK} bytes a block), but 8.0 GiB is available"
    )


def test_this_machine_s_memory_refuses_a_pool_no_machine_holds() -> None:
    """The real probe (MemAvailable, a cgroup's limit): 10**13 blocks are about 900 TiB."""
    assert kvblocks.pool._available_memory() is not None  # Linux: /proc/meminfo
    started = time.perf_counter()
    for make in (
        lambda: BlockPool(10**13),
        lambda: KVCacheManager(num_blocks=10**13, block_size=16),
        lambda: TieredKVCacheManager(10**13, 16, tiers=TierConfig(num_host_blocks=16)),
        lambda: HybridKVCacheManager(10**13, 16),
    ):
        with pytest.raises(ConfigError, match=r"num_blocks=10,000,000,000,000 needs about .* GiB is available"):
            make()
    assert time.perf_counter() - started < 1


def test_a_pool_within_bounds_never_asks_the_os(monkeypatch) -> None:
    def unreadable() -> int:
        raise AssertionError("asked the OS for a small pool")

    monkeypatch.setattr(kvblocks.pool, "_available_memory", unreadable)
    assert BlockPool(100_000).num_blocks == 100_000


def test_an_unknown_amount_of_free_memory_refuses_nothing(monkeypatch) -> None:
    monkeypatch.setattr(kvblocks.pool, "_available_memory", lambda: None)
    monkeypatch.setattr(kvblocks.pool, "_ASK_ABOVE", 0)
    assert BlockPool(1000).num_blocks == 1000
