"""The connector's settings: vLLM's ``kv_connector_extra_config``, checked once, as a dataclass.

::

    kv_transfer_config = {
        "kv_connector": "KVBlocksConnector",
        "kv_connector_module_path": "kvblocks.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"storage": "file", "path": "/mnt/kv"},   # or
        #                            {"storage": "redis", "redis_url": "redis://10.0.0.5:6379/0"},
    }

Every key is optional; an unknown key or a bad value raises :class:`~kvblocks.errors.ConfigError`
when the engine starts, not at the first request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvblocks.errors import ConfigError
from kvblocks.tiers.storage import StorageBackend

__all__ = ["ConnectorSettings", "DEFAULT_PATH"]

DEFAULT_PATH = "~/.cache/kvblocks/vllm"


def _number(value: object, what: str, *, low: float, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= low:
        raise ConfigError(f"kv_connector_extra_config[{what!r}] must be a number >= {low}, got {value!r}")


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` may say (see the module docstring)."""

    storage: str = "file"
    """``"file"``: :class:`~kvblocks.tiers.file_storage.FileStorage` under ``path``; ``"redis"``: a Redis
    server at ``redis_url`` that several engines share."""
    path: str = DEFAULT_PATH
    byte_budget: int | None = None
    """File storage: bytes kept before the least recently used entries go (None: no bound)."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    salt: str | None = None
    """Keeps deployments that share a store and a model apart."""
    max_pending_writes: int = 1024
    """Blocks the background writer queues; a full queue drops its oldest (a future miss, never a wait)."""
    lookup_timeout_s: float = 1.0
    """Longest a request waits for the store to say which of its blocks it holds (then: what is known)."""
    storage_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.storage not in ("file", "redis"):
            raise ConfigError(f"kv_connector_extra_config['storage'] must be 'file' or 'redis', got {self.storage!r}")
        for name in ("path", "redis_url"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"kv_connector_extra_config[{name!r}] must be a non-empty str, got {value!r}")
        if self.salt is not None and (not isinstance(self.salt, str) or not self.salt):
            raise ConfigError(f"kv_connector_extra_config['salt'] must be a non-empty str, got {self.salt!r}")
        budget = self.byte_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise ConfigError(f"kv_connector_extra_config['byte_budget'] must be an int, got {self.byte_budget!r}")
        _number(self.byte_budget, "byte_budget", low=0, allow_none=True)
        if isinstance(self.max_pending_writes, bool) or not isinstance(self.max_pending_writes, int):
            raise ConfigError(
                f"kv_connector_extra_config['max_pending_writes'] must be an int, got {self.max_pending_writes!r}"
            )
        _number(self.max_pending_writes, "max_pending_writes", low=1)
        _number(self.lookup_timeout_s, "lookup_timeout_s", low=0)
        _number(self.storage_timeout_s, "storage_timeout_s", low=0.001)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """The settings ``extra`` names; unknown keys are refused (a typo must not pass silently)."""
        if extra is None:
            return cls()
        if not isinstance(extra, Mapping):
            raise ConfigError(f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in extra if k not in known)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown keys {unknown}; known: {', '.join(sorted(known))}"
            )
        return cls(**dict(extra))

    def open_storage(self, *, writes: bool = True) -> StorageBackend:
        """A new connection to the configured store. ``writes=False``: for a connector half that only looks
        up (the scheduler's), a file store skips indexing the directory at start-up and does not demand
        that it be writable; a half that saves gets a :class:`ConfigError` naming a directory it cannot
        write, at start, instead of serving with every save failing."""
        if self.storage == "redis":
            from kvblocks.tiers.redis_storage import RedisStorage

            return RedisStorage(self.redis_url)
        from kvblocks.tiers.file_storage import FileStorage

        return FileStorage(
            os.path.expanduser(self.path), byte_budget=self.byte_budget, index_existing=writes, check_writable=writes
        )
