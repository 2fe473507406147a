"""One way to open a Redis connection for kvblocks' Redis users (storage tier, event streams).

redis-py is imported here, lazily, so ``import kvblocks`` never loads it.

Retries: a call that fails on a connection error or a timeout is tried again, at most
``retries`` more times, after an equal-jitter exponential backoff (redis-py's
:class:`redis.retry.Retry` with :class:`redis.backoff.EqualJitterBackoff`), so a
dropped connection or a server restarting costs one backoff, not one lost call. Only
calls that may run twice are retried: the client's read commands in :data:`RETRIED`
(``GET``, ``MGET``, ``EXISTS``, ``XREAD``, ``XRANGE``, ``XREVRANGE``, ``PING``), and what a
caller wraps in :func:`retrying` itself (RedisStorage: its pipelines of ``SET`` of
content-addressed entries and of ``EXISTS``). Anything else -- ``XADD`` without an explicit
id above all, which would add the entry twice when the first reply was lost -- runs once.

A call therefore takes at most ``(retries + 1) * 2 * socket_timeout + retries * backoff_cap``
seconds: every attempt opens a connection if it has none (bounded by the timeout) and
sends the command (bounded by the timeout), and every backoff is at most ``backoff_cap``.
redis-py's own connection-level retry is off, so attempts never multiply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kvblocks.errors import ConfigError, MissingExtraError

__all__ = ["DEFAULT_BACKOFF_BASE", "DEFAULT_BACKOFF_CAP", "DEFAULT_RETRIES", "RETRIED", "connect", "retrying"]

T = TypeVar("T")

DEFAULT_RETRIES = 2
DEFAULT_BACKOFF_BASE = 0.05
DEFAULT_BACKOFF_CAP = 0.5

RETRIED: frozenset[str] = frozenset({"GET", "MGET", "EXISTS", "XREAD", "XRANGE", "XREVRANGE", "PING"})
"""Commands the client retries by itself: reads, which may run twice."""

_client_class: type[Any] | None = None


def check_retry_settings(retries: object, backoff_base: object, backoff_cap: object) -> None:
    """Raise :class:`ConfigError` unless ``retries`` is an int >= 0 and the backoff bounds are numbers >= 0."""
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"retries must be an int >= 0, got {retries!r}")
    for name, bound in (("backoff_base", backoff_base), ("backoff_cap", backoff_cap)):
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 <= bound < float("inf"):
            raise ConfigError(f"{name} must be a finite number >= 0, got {bound!r}")
    if backoff_cap < backoff_base:  # type: ignore[operator]
        raise ConfigError(f"backoff_cap ({backoff_cap!r}) must be >= backoff_base ({backoff_base!r})")


def _ignore(_error: Exception) -> None:
    """Nothing to do between attempts: redis-py already dropped the failed connection."""


def retrying(client: Any, call: Callable[[], T]) -> T:
    """``call()``, retried with ``client``'s retry policy (a client from :func:`connect`). ``call`` must be
    safe to run twice; it should build what it sends (a pipeline is emptied by a failed execute)."""
    result: T = client.kvblocks_retry.call_with_retry(call, _ignore)
    return result


def _make_client_class() -> type[Any]:
    """redis.Redis, retrying the commands of :data:`RETRIED` (created once, on first use: redis is optional)."""
    global _client_class
    if _client_class is None:
        import redis

        class _Client(redis.Redis):
            kvblocks_retry: Any

            def execute_command(self, *args: Any, **options: Any) -> Any:
                name = args[0]
                if isinstance(name, bytes):
                    name = name.decode("ascii", "replace")
                parent: Any = super().execute_command  # untyped in redis-py
                if str(name).upper() in RETRIED:
                    return self.kvblocks_retry.call_with_retry(lambda: parent(*args, **options), _ignore)
                return parent(*args, **options)

        _client_class = _Client
    return _client_class


def connect(
    url: str,
    socket_timeout: float,
    *,
    user: str,
    retries: int = DEFAULT_RETRIES,
    backoff_base: float = DEFAULT_BACKOFF_BASE,
    backoff_cap: float = DEFAULT_BACKOFF_CAP,
) -> tuple[Any, tuple[type[BaseException], ...]]:
    """A client for ``url`` whose every attempt is bounded by ``socket_timeout``, and the errors a call can raise.

    The client retries its :data:`RETRIED` commands (see the module docstring); its
    ``kvblocks_retry`` is the :class:`redis.retry.Retry` doing it, for :func:`retrying`.
    ``user`` names the caller in the error raised when redis-py is not installed.
    """
    check_retry_settings(retries, backoff_base, backoff_cap)
    try:
        import redis
        from redis.backoff import EqualJitterBackoff, NoBackoff
        from redis.retry import Retry
    except ImportError as error:
        raise MissingExtraError(f"{user} needs the redis package", "redis") from error
    client_class = _make_client_class()
    try:
        client = client_class.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),  # redis-py's per-connection retry: off, the calls retry instead
        )
    except ValueError as error:
        raise ConfigError(f"not a Redis URL: {url!r} ({error})") from error
    client.kvblocks_retry = Retry(EqualJitterBackoff(cap=float(backoff_cap), base=float(backoff_base)), retries)
    return client, (redis.exceptions.RedisError, OSError)
