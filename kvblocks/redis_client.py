"""One way to open a Redis connection for kvblocks' Redis users (storage tier, event streams).

redis-py is imported here, lazily, so ``import kvblocks`` never loads it.
"""

from __future__ import annotations

from typing import Any

from kvblocks.errors import BackendUnavailableError, ConfigError

__all__ = ["connect"]


def connect(url: str, socket_timeout: float, *, user: str) -> tuple[Any, tuple[type[BaseException], ...]]:
    """A client for ``url`` whose every call is bounded by ``socket_timeout``, and the errors a call can raise.

    ``user`` names the caller in the error raised when redis-py is not installed.
    """
    try:
        import redis
    except ImportError as error:
        raise BackendUnavailableError(f'{user} needs the redis package: pip install "kvblocks[redis]"') from error
    try:
        client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout, retry_on_timeout=False
        )
    except ValueError as error:
        raise ConfigError(f"not a Redis URL: {url!r} ({error})") from error
    return client, (redis.exceptions.RedisError, OSError)
