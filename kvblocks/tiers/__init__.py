"""Host and storage tiers (in progress): block entries, keys and storage backends.

Importing this package does not import torch or redis.
"""

from kvblocks.tiers.entry import EntryFormat, block_key, namespace_tag
from kvblocks.tiers.file_storage import FileStorage
from kvblocks.tiers.redis_storage import RedisStorage
from kvblocks.tiers.storage import MemoryStorage, StorageBackend, StorageStats, usable_prefix

__all__ = [
    "EntryFormat",
    "FileStorage",
    "MemoryStorage",
    "RedisStorage",
    "StorageBackend",
    "StorageStats",
    "block_key",
    "namespace_tag",
    "usable_prefix",
]
