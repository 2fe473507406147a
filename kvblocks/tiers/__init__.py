"""Host and storage tiers under the device cache.

Importing this package does not import torch or redis (:class:`TransferExecutor`, which
moves tensors, is imported from :mod:`kvblocks.tiers.executor`).
"""

from kvblocks.tiers.config import HOST_POLICIES, STORAGE_POLICIES, TierConfig
from kvblocks.tiers.entry import EntryFormat, block_key, namespace_tag
from kvblocks.tiers.file_storage import FileStorage
from kvblocks.tiers.host import HostTier
from kvblocks.tiers.manager import TieredKVCacheManager, TierStats
from kvblocks.tiers.redis_storage import RedisStorage
from kvblocks.tiers.storage import MemoryStorage, StorageBackend, StorageStats, usable_prefix
from kvblocks.tiers.storage_tier import StorageTier, StorageTierStats
from kvblocks.tiers.transfers import AdmittedTable, BlockSave, LoadResult, TransferPlan
from kvblocks.tiers.writer import AsyncWriter, WriterStats

__all__ = [
    "HOST_POLICIES",
    "STORAGE_POLICIES",
    "AdmittedTable",
    "AsyncWriter",
    "BlockSave",
    "EntryFormat",
    "FileStorage",
    "HostTier",
    "LoadResult",
    "MemoryStorage",
    "RedisStorage",
    "StorageBackend",
    "StorageStats",
    "StorageTier",
    "StorageTierStats",
    "TierConfig",
    "TierStats",
    "TieredKVCacheManager",
    "TransferPlan",
    "WriterStats",
    "block_key",
    "namespace_tag",
    "usable_prefix",
]
