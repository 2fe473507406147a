"""The manager's previous home (one release): it lives in :mod:`kvblocks.core.manager` now."""

from kvblocks.core.manager import KVCacheManager
from kvblocks.core.sequence import BlockTable
from kvblocks.core.sequence import _count_arg as _count_arg  # re-exported
from kvblocks.core.sequence import _Sequence as _Sequence  # re-exported

__all__ = ["BlockTable", "KVCacheManager"]
