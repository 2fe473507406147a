"""Where an engine integration keeps its KV pages: the settings every integration's extra config shares.

vLLM's connector (``kv_connector_extra_config``) and SGLang's HiCache backend (``--hicache-storage-backend-
extra-config``) both read these keys; each integration adds its own beside them. An unknown key or a bad
value raises :class:`~kvblocks.errors.ConfigError` when the engine starts, not at the first request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

from kvblocks.errors import ConfigError
from kvblocks.tiers.storage import StorageBackend

__all__ = ["StoreSettings"]

S = TypeVar("S", bound="StoreSettings")


@dataclass(frozen=True)
class StoreSettings:
    """The store: files under ``path`` (one machine, or a shared file system) or a Redis server."""

    where: ClassVar[str] = "extra config"
    """What the engine calls the mapping these settings come from (error messages name it)."""
    passed_through: ClassVar[frozenset[str]] = frozenset()
    """Keys the engine itself reads from the same mapping: accepted, ignored here."""

    storage: str = "file"
    """``"file"``: :class:`~kvblocks.tiers.file_storage.FileStorage` under ``path``; ``"redis"``: a Redis
    server at ``redis_url`` that several engines share."""
    path: str = "~/.cache/kvblocks"
    byte_budget: int | None = None
    """File storage: bytes kept before the least recently used entries go (None: no bound)."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    salt: str | None = None
    """Keeps deployments that share a store and a model apart."""
    max_pending_writes: int = 1024
    """Blocks the background writer queues; a full queue drops its oldest (a future miss, never a wait)."""
    storage_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        where = self.where
        if self.storage not in ("file", "redis"):
            raise ConfigError(f"{where}['storage'] must be 'file' or 'redis', got {self.storage!r}")
        for name in ("path", "redis_url"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}[{name!r}] must be a non-empty str, got {value!r}")
        if self.salt is not None and (not isinstance(self.salt, str) or not self.salt):
            raise ConfigError(f"{where}['salt'] must be a non-empty str, got {self.salt!r}")
        budget = self.byte_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise ConfigError(f"{where}['byte_budget'] must be an int, got {self.byte_budget!r}")
        self.check_number("byte_budget", low=0, allow_none=True)
        if isinstance(self.max_pending_writes, bool) or not isinstance(self.max_pending_writes, int):
            raise ConfigError(f"{where}['max_pending_writes'] must be an int, got {self.max_pending_writes!r}")
        self.check_number("max_pending_writes", low=1)
        self.check_number("storage_timeout_s", low=0.001)

    def check_number(self, name: str, *, low: float, allow_none: bool = False) -> None:
        """Refuse field ``name`` unless it is a number (not a bool) >= ``low`` (or None, when allowed)."""
        value = getattr(self, name)
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= low:
            raise ConfigError(f"{self.where}[{name!r}] must be a number >= {low}, got {value!r}")

    @classmethod
    def from_extra_config(cls: type[S], extra: Mapping[str, Any] | None) -> S:
        """The settings ``extra`` names; unknown keys are refused (a typo must not pass silently)."""
        if extra is None:
            return cls()
        if not isinstance(extra, Mapping):
            raise ConfigError(f"{cls.where} must be a mapping, got {type(extra).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in extra if k not in known and k not in cls.passed_through)
        if unknown:
            raise ConfigError(f"{cls.where} has unknown keys {unknown}; known: {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in extra.items() if k in known})

    def open_storage(self, *, writes: bool = True) -> StorageBackend:
        """A new connection to the configured store. ``writes=False``: for a part that only looks up, a file
        store skips indexing the directory at start-up and does not demand that it be writable; a part that
        saves gets a :class:`ConfigError` naming a directory it cannot write, at start, instead of serving
        with every save failing."""
        if self.storage == "redis":
            from kvblocks.tiers.redis_storage import RedisStorage

            return RedisStorage(self.redis_url)
        from kvblocks.tiers.file_storage import FileStorage

        return FileStorage(
            os.path.expanduser(self.path), byte_budget=self.byte_budget, index_existing=writes, check_writable=writes
        )
