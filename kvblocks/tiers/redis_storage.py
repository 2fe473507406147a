"""RedisStorage: block entries in a Redis (or Valkey) server shared by several nodes.

Configured by URL (``redis://host:6379/0``, ``rediss://`` for TLS, ``unix://``). Batches go
out as one pipeline (one round trip); an optional TTL lets the server expire entries.
A call that fails on a dropped connection or a timeout is tried again, at most ``retries``
more times after a jittered exponential backoff between ``backoff_base`` and ``backoff_cap``
seconds (redis-py's ``Retry``; see :mod:`kvblocks.redis_client`): writes are ``SET`` of
content-addressed entries and reads are ``MGET``/``EXISTS``, so running one twice is
harmless; ``DEL`` runs once. A call takes at most
``(retries + 1) * 2 * socket_timeout + retries * backoff_cap`` seconds (7.0 s with the
defaults), so a server that is down or does not answer never holds the writer or reader
thread longer: its reads become misses and its writes drops -- counted, never raised --
and serving resumes by itself when the server is back.

Needs the ``redis`` package (``pip install "kvblocks[redis]"``), imported when a
RedisStorage is created.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from kvblocks.errors import ConfigError
from kvblocks.redis_client import (
    DEFAULT_BACKOFF_BASE,
    DEFAULT_BACKOFF_CAP,
    DEFAULT_RETRIES,
    check_retry_settings,
    connect,
    retrying,
)
from kvblocks.tiers.entry import valid_key
from kvblocks.tiers.storage import StorageStats

__all__ = ["RedisStorage"]


class RedisStorage:
    """Block entries under ``prefix + key`` in a Redis-protocol server (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        ttl_seconds: float | None = None,
        socket_timeout: float = 1.0,
        prefix: str = "kvblocks:",
        retries: int = DEFAULT_RETRIES,
        backoff_base: float = DEFAULT_BACKOFF_BASE,
        backoff_cap: float = DEFAULT_BACKOFF_CAP,
    ) -> None:
        if ttl_seconds is not None and (isinstance(ttl_seconds, bool) or not ttl_seconds > 0):
            raise ConfigError(f"ttl_seconds must be > 0 or None, got {ttl_seconds!r}")
        if isinstance(socket_timeout, bool) or not isinstance(socket_timeout, (int, float)) or not socket_timeout > 0:
            raise ConfigError(f"socket_timeout must be a number > 0, got {socket_timeout!r}")
        if not isinstance(prefix, str):
            raise ConfigError(f"prefix must be a str, got {type(prefix).__name__}")
        check_retry_settings(retries, backoff_base, backoff_cap)
        self._client: Any
        backoff = {"backoff_base": backoff_base, "backoff_cap": backoff_cap}
        self._client, self._errors = connect(url, socket_timeout, user="RedisStorage", retries=retries, **backoff)
        self._ttl_ms = None if ttl_seconds is None else max(1, int(ttl_seconds * 1000))
        self._prefix = prefix
        self.url = url
        self.stats = StorageStats()

    def _names(self, keys: Sequence[str]) -> list[str]:
        return [self._prefix + valid_key(key) for key in keys]

    def put(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]]) -> int:
        names = self._names([key for key, _ in items])
        if not names:
            return 0

        def write() -> list[Any]:  # a new pipeline per attempt: a failed execute empties it
            pipe = self._client.pipeline(transaction=False)
            for name, (_, value) in zip(names, items):
                pipe.set(name, value, px=self._ttl_ms)
            result: list[Any] = pipe.execute(raise_on_error=False)
            return result

        try:
            results = retrying(self._client, write)
        except self._errors:
            self.stats.put_errors += len(names)
            return 0
        written = 0
        for result, (_, value) in zip(results, items):
            if result is True:
                written += 1
                self.stats.puts += 1
                self.stats.put_bytes += len(value)
            else:
                self.stats.put_errors += 1
        return written

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        names = self._names(keys)
        if not names:
            return []
        self.stats.gets += len(names)
        try:
            values: list[bytes | None] = self._client.mget(names)
        except self._errors:
            self.stats.get_errors += len(names)
            self.stats.misses += len(names)
            return [None] * len(names)
        hits = sum(1 for v in values if v is not None)
        self.stats.hits += hits
        self.stats.misses += len(names) - hits
        return values

    def exists(self, keys: Sequence[str]) -> list[bool]:
        names = self._names(keys)
        if not names:
            return []

        def ask() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            result: list[Any] = pipe.execute()
            return result

        try:
            return [bool(flag) for flag in retrying(self._client, ask)]
        except self._errors:
            self.stats.get_errors += 1
            return [False] * len(names)

    def contains(self, keys: Sequence[str]) -> int:
        count = 0
        for present in self.exists(keys):
            if not present:
                break
            count += 1
        return count

    def delete(self, keys: Sequence[str]) -> int:
        names = self._names(keys)
        if not names:
            return 0
        try:
            removed = int(self._client.delete(*names))
        except self._errors:
            return 0
        self.stats.deletes += removed
        return removed

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self._client.close()
