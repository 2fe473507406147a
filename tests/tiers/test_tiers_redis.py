"""RedisStorage against a real redis-server (never a fake): behaviour, TTL, and the server failing."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
import uuid

import pytest
from redis.backoff import EqualJitterBackoff
from redis.retry import Retry

from kvblocks.errors import BackendUnavailableError, ConfigError, InvalidArgumentError
from kvblocks.redis_client import connect
from kvblocks.tiers import RedisStorage, StorageBackend
from tests.support.storage import FORMAT, PAYLOAD, keys


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


def test_a_server_that_never_answers_costs_one_timeout_without_retries(redis_url) -> None:
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
        storage = RedisStorage(f"redis://127.0.0.1:{port}/0", socket_timeout=0.3, retries=0)
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


# ---------------------------------------------------------------- retries (redis-py's Retry with backoff)


class DroppingProxy:
    """A TCP proxy on 127.0.0.1 to a real server that closes the first ``drop`` connections once they
    sent a command (before forwarding it), as a server restarting or a load balancer would."""

    def __init__(self, target_port: int, drop: int) -> None:
        self.target_port = target_port
        self.drop = drop
        self.accepted = 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()[0]
            except OSError:
                return
            self.accepted += 1
            self.sockets.append(conn)
            if self.accepted <= self.drop:
                conn.recv(65536)  # the command arrives, and is never forwarded
                conn.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.sockets.append(upstream)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()


@pytest.fixture
def redis_port(redis_url) -> int:
    return int(redis_url.rsplit(":", 1)[1].split("/")[0])


def test_a_dropped_connection_is_retried_for_reads_and_writes(redis_url, redis_port) -> None:
    """Each call meets a dropped connection first: the retry gets it through (before: a miss, a drop)."""
    prefix = f"retry-{uuid.uuid4().hex[:8]}:"
    k = keys("0a", "0b")
    for call in ("put", "get", "exists"):
        proxy = DroppingProxy(redis_port, drop=1)
        storage = RedisStorage(proxy.url, prefix=prefix)  # the default retries
        try:
            if call == "put":
                assert storage.put([(k[0], b"A")]) == 1
                assert storage.stats.put_errors == 0
            elif call == "get":
                assert storage.get(k) == [b"A", None]
                assert storage.stats.get_errors == 0
            else:
                assert storage.exists(k) == [True, False]
            assert proxy.accepted == 2  # the dropped connection, then the retry's
        finally:
            storage.close()
            proxy.close()
    RedisStorage(redis_url, prefix=prefix).delete(k)


def test_retries_are_bounded_by_the_configured_count(redis_port) -> None:
    proxy = DroppingProxy(redis_port, drop=3)
    storage = RedisStorage(proxy.url, retries=1, backoff_base=0.01, backoff_cap=0.02)
    try:
        assert storage.get(keys("0a")) == [None]  # two attempts, both dropped
        assert proxy.accepted == 2 and storage.stats.get_errors == 1
        assert storage.get(keys("0a")) == [None]  # the third drop, then through
        assert proxy.accepted == 4 and storage.stats.get_errors == 1
    finally:
        storage.close()
        proxy.close()


def test_the_client_is_built_with_a_retry_of_the_configured_count(redis_url) -> None:
    storage = RedisStorage(redis_url, retries=5, backoff_base=0.1, backoff_cap=0.4)
    retry = storage._client.kvblocks_retry
    assert isinstance(retry, Retry) and retry.get_retries() == 5
    assert retry._backoff == EqualJitterBackoff(cap=0.4, base=0.1)
    connection = storage._client.connection_pool.make_connection()
    assert connection.retry.get_retries() == 0  # redis-py's own per-connection retry is off: no nesting
    storage.close()
    client, _ = connect(redis_url, 1.0, user="test")  # the event transport's client: the defaults
    assert client.kvblocks_retry.get_retries() == 2
    client.close()


def test_xadd_is_never_retried_but_xread_is(redis_port) -> None:
    """An XADD whose reply was lost may have been applied: running it again would add the entry twice."""
    stream = f"retry-stream-{uuid.uuid4().hex[:8]}"
    proxy = DroppingProxy(redis_port, drop=1)
    client, errors = connect(proxy.url, 1.0, user="test", backoff_base=0.01, backoff_cap=0.02)
    try:
        with pytest.raises(errors):
            client.xadd(stream, {"d": b"x"})
        assert proxy.accepted == 1  # not tried again
        client.xadd(stream, {"d": b"y"})
        proxy.drop = 3  # the next new connection is dropped too: XREAD goes through on the retry
        client.connection_pool.disconnect()
        reply = client.xread({stream: "0"}, count=10)
        assert [fields[b"d"] for _, fields in reply[0][1]] == [b"y"]
        assert proxy.accepted == 4
        client.delete(stream)
    finally:
        client.close()
        proxy.close()


def test_a_server_that_never_answers_holds_a_call_at_most_the_documented_bound(redis_url) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        port = listener.getsockname()[1]
        storage = RedisStorage(f"redis://127.0.0.1:{port}/0", socket_timeout=0.2, retries=2, backoff_cap=0.1)
        start = time.monotonic()
        assert storage.get(keys("0a")) == [None]
        elapsed = time.monotonic() - start
        # 3 attempts, each one timeout (the connection opens at once), plus 2 backoffs <= 0.1 s
        assert 3 * 0.2 <= elapsed <= (2 + 1) * 2 * 0.2 + 2 * 0.1 + 0.5
    finally:
        listener.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"retries": -1}, "retries must be an int >= 0"),
        ({"retries": 1.5}, "retries must be an int >= 0"),
        ({"retries": True}, "retries must be an int >= 0"),
        ({"backoff_base": -0.1}, "backoff_base must be a finite number >= 0"),
        ({"backoff_cap": float("inf")}, "backoff_cap must be a finite number >= 0"),
        ({"backoff_cap": "1"}, "backoff_cap must be a finite number >= 0"),
        ({"backoff_base": 1.0, "backoff_cap": 0.5}, "backoff_cap .* must be >= backoff_base"),
    ],
)
def test_retry_settings_are_validated(redis_url, kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        RedisStorage(redis_url, **kwargs)
