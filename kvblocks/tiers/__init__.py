"""Host and storage tiers under the device cache.

Importing this package does not import torch or redis: :class:`TransferExecutor`, which
moves tensors, is loaded on first use (and needs the ``torch`` extra).
"""

from typing import Any

from kvblocks.tiers.config import HOST_POLICIES, STORAGE_POLICIES, TierConfig
from kvblocks.tiers.entry import EntryFormat, block_key, group_tag, namespace_tag
from kvblocks.tiers.file_storage import FileStorage
from kvblocks.tiers.host import HostTier
from kvblocks.tiers.kinds import TIER_KINDS, TierFactory, TierPlace, register_tier_kind, unregister_tier_kind
from kvblocks.tiers.pending import TierStats
from kvblocks.tiers.protocol import KEYED, SLOT, KeyedTier, SlotTier, Tier
from kvblocks.tiers.redis_storage import RedisStorage
from kvblocks.tiers.stack import TierStack
from kvblocks.tiers.storage import MemoryStorage, StorageBackend, StorageStats, usable_prefix
from kvblocks.tiers.storage_tier import StorageTier, StorageTierStats
from kvblocks.tiers.tiering import Tiering
from kvblocks.tiers.transfers import AdmittedTable, BlockSave, GroupTransfers, LoadResult, TransferPlan
from kvblocks.tiers.writer import AsyncWriter, WriterStats

__all__ = [
    "HOST_POLICIES",
    "KEYED",
    "SLOT",
    "STORAGE_POLICIES",
    "TIER_KINDS",
    "AdmittedTable",
    "AsyncWriter",
    "BlockSave",
    "EntryFormat",
    "FileStorage",
    "GroupTransfers",
    "HostTier",
    "KeyedTier",
    "LoadResult",
    "MemoryStorage",
    "RedisStorage",
    "SlotTier",
    "StorageBackend",
    "StorageStats",
    "StorageTier",
    "StorageTierStats",
    "Tier",
    "TierConfig",
    "TierFactory",
    "TierPlace",
    "TierStack",
    "TierStats",
    "TieredKVCacheManager",
    "Tiering",
    "TransferExecutor",
    "TransferPlan",
    "WriterStats",
    "block_key",
    "group_tag",
    "namespace_tag",
    "register_tier_kind",
    "unregister_tier_kind",
    "usable_prefix",
]


def __getattr__(name: str) -> Any:
    if name == "TieredKVCacheManager":  # the previous release's name, built over the manager (kvblocks.presets)
        from kvblocks.presets import TieredKVCacheManager

        globals()[name] = TieredKVCacheManager
        return TieredKVCacheManager
    if name == "TransferExecutor":  # torch-backed: imported only when asked for
        from kvblocks.tiers.executor import TransferExecutor

        globals()[name] = TransferExecutor
        return TransferExecutor
    raise AttributeError(f"module 'kvblocks.tiers' has no attribute {name!r}")
