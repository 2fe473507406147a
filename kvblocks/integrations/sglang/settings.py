"""The backend's settings: SGLang's ``--hicache-storage-backend-extra-config``, checked once, as a dataclass.

::

    {"backend_name": "kvblocks", "module_path": "kvblocks.integrations.sglang",
     "class_name": "KVBlocksHiCacheStorage", "interface_v1": 1,        <- SGLang's own keys
     "storage": "file", "path": "/mnt/kv"}                             <- or "storage": "redis", "redis_url": ...

Besides SGLang's keys (those four, and its prefetch knobs), every key is kvblocks' and optional; an unknown key
or a bad value raises :class:`~kvblocks.errors.ConfigError` when SGLang attaches the backend, not at the first
page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvblocks.integrations.store_settings import StoreSettings

__all__ = ["HiCacheSettings"]


@dataclass(frozen=True)
class HiCacheSettings(StoreSettings):
    """What ``--hicache-storage-backend-extra-config`` may say besides SGLang's own keys (the store, and how
    long an existence check may wait)."""

    where: ClassVar[str] = "hicache-storage-backend-extra-config"
    passed_through: ClassVar[frozenset[str]] = frozenset(
        {
            # what SGLang 0.5.23 reads from the same mapping (the last five it takes out before the backend
            # sees it, on the paths that parse them)
            "backend_name",
            "module_path",
            "class_name",
            "interface_v1",
            "prefetch_threshold",
            "prefetch_timeout_base",
            "prefetch_timeout_per_ki_token",
            "hicache_storage_pass_prefix_keys",
            "tp_lcm_size",
        }
    )

    path: str = "~/.cache/kvblocks/sglang"
    lookup_timeout_s: float = 1.0
    """Longest ``batch_exists`` waits for the store (then: the pages known so far)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_number("lookup_timeout_s", low=0)
