"""kvblocks: the KV-cache management layer an LLM inference engine imports.

It owns which KV blocks exist, who holds them and which prefixes they cache. The
core (this package's top level) is pure Python plus numpy and xxhash; torch is
imported only by :mod:`kvblocks.backends`, when a backend is used.

>>> import kvblocks
>>> m = kvblocks.KVCacheManager(num_blocks=64, block_size=16)
>>> m.add_sequence("req-1", list(range(40)))
>>> m.allocate("req-1", 40) is not None
True
"""

import logging as _logging

from kvblocks import native  # first: its import installs the finder that picks compiled or source
from kvblocks.accounting import CachedTokens, CacheStats, HitCounters
from kvblocks.config import CacheConfig
from kvblocks.core.eviction import EVICTION_POLICIES, LRU, S3FIFO, EvictionPolicy
from kvblocks.core.manager import BlockTable, KVCacheManager
from kvblocks.core.pool import BlockPool
from kvblocks.core.prefix_tree import PrefixMatch, PrefixTree
from kvblocks.disagg import (
    DecodeAdmission,
    DecodeManager,
    DisaggConfig,
    HandoffGroup,
    PrefillHandoff,
    PrefillManager,
    RequestUsage,
    TieredDecodeManager,
    TieredPrefillManager,
    manager_for_role,
)
from kvblocks.errors import (
    AccountingError,
    AttachTimeoutError,
    BackendUnavailableError,
    CommitOutOfRangeError,
    ConfigError,
    DoubleFreeError,
    DuplicateSequenceError,
    EventDecodeError,
    HandoffError,
    IntegrityError,
    InvalidArgumentError,
    InvalidBlockHashError,
    InvalidBlockIdError,
    InvalidTokenError,
    KVBlocksError,
    MissingExtraError,
    SequenceStateError,
    StaleLookupError,
    UnknownSequenceError,
)
from kvblocks.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventConsumer,
    EventPublisher,
    EventRecord,
    EventSink,
    KVEvent,
    decode_batch,
    encode_batch,
)
from kvblocks.hashing import (
    BlockExtras,
    BlockHash,
    BlockHasher,
    HashedTokens,
    MultimodalItem,
    Namespace,
    block_hashes,
    blocks_overlapping,
)

# A library's loggers get a NullHandler only: the application decides where lines go (none configured: nowhere,
# rather than bare on stderr). What matters is also counted where users look (docs/metrics.md).
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # how the hot modules run: compiled or from source (kvblocks.native.status())
    "native",
    # manager
    "KVCacheManager",
    "CacheConfig",
    "BlockTable",
    # disaggregation
    "DisaggConfig",
    "PrefillManager",
    "DecodeManager",
    "PrefillHandoff",
    "HandoffGroup",
    "DecodeAdmission",
    "RequestUsage",
    "TieredDecodeManager",
    "TieredPrefillManager",
    "manager_for_role",
    # accounting
    "CachedTokens",
    "CacheStats",
    "HitCounters",
    # identity
    "block_hashes",
    "blocks_overlapping",
    "BlockHash",
    "BlockHasher",
    "HashedTokens",
    "BlockExtras",
    "MultimodalItem",
    "Namespace",
    # structures
    "BlockPool",
    "EVICTION_POLICIES",
    "EvictionPolicy",
    "LRU",
    "S3FIFO",
    "PrefixTree",
    "PrefixMatch",
    # events
    "EventSink",
    "EventRecord",
    "KVEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "EventBatch",
    "EventPublisher",
    "EventConsumer",
    "encode_batch",
    "decode_batch",
    # errors
    "KVBlocksError",
    "ConfigError",
    "InvalidTokenError",
    "InvalidBlockHashError",
    "InvalidArgumentError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "DoubleFreeError",
    "SequenceStateError",
    "StaleLookupError",
    "CommitOutOfRangeError",
    "InvalidBlockIdError",
    "AccountingError",
    "IntegrityError",
    "BackendUnavailableError",
    "MissingExtraError",
    "AttachTimeoutError",
    "HandoffError",
    "EventDecodeError",
]
