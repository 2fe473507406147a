"""RedisStorage against a real redis-server (never a fake): behaviour, TTL, and the server failing."""

from __future__ import annotations

import socket
import sys
import threading
import time
import uuid

import pytest

from kvblocks.errors import BackendUnavailableError, ConfigError, InvalidArgumentError
from kvblocks.tiers import RedisStorage, StorageBackend

from .test_tiers_storage import FORMAT, PAYLOAD, keys


@pytest.fixture
def redis_storage(redis_url):
    storage = RedisStorage(redis_url, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    yield storage
    storage.close()


def test_put_get_contains_delete(redis_storage) -> None:
    assert isinstance(redis_storage, StorageBackend)
    k = keys("0a", "0b", "0c", "0d")
    assert redis_storage.put([(k[0], b"A"), (k[2], b"C"), (k[3], b"D")]) == 3
    assert redis_storage.get(k) == [b"A", None, b"C", b"D"]
    assert redis_storage.contains(k) == 1  # prefix semantics
    assert redis_storage.contains(k[2:]) == 2
    assert redis_storage.exists(k) == [True, False, True, True]
    assert redis_storage.delete([k[0], k[1]]) == 1
    assert redis_storage.contains(k) == 0
    stats = redis_storage.stats
    assert (stats.puts, stats.gets, stats.hits, stats.misses, stats.deletes) == (3, 4, 3, 1, 1)
    assert redis_storage.put([]) == 0 and redis_storage.get([]) == [] and redis_storage.contains([]) == 0


def test_entries_round_trip_through_the_server(redis_storage) -> None:
    (k,) = keys("0a")
    redis_storage.put([(k, FORMAT.encode(PAYLOAD))])
    payload, why = FORMAT.decode(redis_storage.get([k])[0])
    assert why == "" and bytes(payload) == PAYLOAD


def test_prefixes_keep_deployments_apart(redis_url) -> None:
    a, b = RedisStorage(redis_url, prefix="dep-a:"), RedisStorage(redis_url, prefix="dep-b:")
    (k,) = keys("0a")
    a.put([(k, b"mine")])
    assert b.get([k]) == [None] and a.get([k]) == [b"mine"]
    a.delete([k])


def test_ttl_expires_entries(redis_url) -> None:
    storage = RedisStorage(redis_url, ttl_seconds=0.2, prefix=f"ttl-{uuid.uuid4().hex[:8]}:")
    (k,) = keys("0a")
    storage.put([(k, b"short-lived")])
    assert storage.get([k]) == [b"short-lived"]
    time.sleep(0.5)
    assert storage.get([k]) == [None]


def test_a_killed_server_gives_counted_misses_and_serving_resumes(private_redis) -> None:
    storage = RedisStorage(private_redis.url, socket_timeout=0.5)
    k = keys("0a", "0b")
    assert storage.put([(k[0], b"before")]) == 1
    private_redis.stop()  # killed mid-run
    start = time.monotonic()
    assert storage.get(k) == [None, None]
    assert storage.put([(k[1], b"lost")]) == 0
    assert storage.contains(k) == 0 and storage.delete(k) == 0 and storage.exists(k) == [False, False]
    assert time.monotonic() - start < 5  # bounded by the socket timeout, no hang
    assert storage.stats.get_errors >= 2 and storage.stats.put_errors == 1
    private_redis.start()  # back (empty: no persistence)
    assert storage.put([(k[1], b"after")]) == 1
    assert storage.get(k) == [None, b"after"]


def test_a_server_that_never_answers_costs_one_timeout(redis_url) -> None:
    """A listener that accepts connections and never replies: reads are misses after the timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        port = listener.getsockname()[1]
        storage = RedisStorage(f"redis://127.0.0.1:{port}/0", socket_timeout=0.3)
        start = time.monotonic()
        assert storage.get(keys("0a")) == [None]
        assert storage.put([(keys("0a")[0], b"v")]) == 0
        assert time.monotonic() - start < 3
        assert storage.stats.get_errors == 1 and storage.stats.put_errors == 1
    finally:
        stop.set()
        thread.join(timeout=2)
        for conn in held:
            conn.close()
        listener.close()


def test_configuration_errors(redis_url, monkeypatch) -> None:
    with pytest.raises(ConfigError, match="Redis URL"):
        RedisStorage("http://127.0.0.1:1")
    with pytest.raises(ConfigError):
        RedisStorage(redis_url, ttl_seconds=0)
    with pytest.raises(ConfigError):
        RedisStorage(redis_url, socket_timeout=0)
    with pytest.raises(ConfigError):
        RedisStorage(redis_url, socket_timeout=True)
    with pytest.raises(ConfigError):
        RedisStorage(redis_url, prefix=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        RedisStorage(redis_url).get(["../etc"])
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(BackendUnavailableError, match=r"kvblocks\[redis\]"):
        RedisStorage(redis_url)
