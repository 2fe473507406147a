"""Storage backends against the raw I/O they wrap, same bytes, same run.

FileStorage (temp file + rename, sharding, index) against writing and reading the same bytes
to plain files; RedisStorage (validation, prefixes, counters) against a bare redis-py
pipeline of SET / MGET. Entries are 16-token blocks of a Llama-3-8B-shaped cache (32 layers,
8 KV heads, head_dim 128, bf16): 2 MiB per block over all layers, or 256 KiB per group of
4 layers.
"""

from __future__ import annotations

import os
import random

import pytest

from kvblocks.tiers import FileStorage, RedisStorage

SIZES = {"2MiB-block": 2 << 20, "256KiB-layer-group": 256 << 10}
BATCH_BYTES = 32 << 20


def _entries(size: str) -> list[tuple[str, bytes]]:
    width = SIZES[size]
    rng = random.Random(width)
    blob = rng.randbytes(width)
    count = max(4, BATCH_BYTES // width)
    return [(f"xxh3-128.{'0' * 16}.b{i:04x}{rng.getrandbits(64):016x}", blob) for i in range(count)]


def _tag(benchmark, group: str, subject: str, entries) -> None:
    benchmark.group = group
    benchmark.extra_info["subject"] = subject
    benchmark.extra_info["entries"] = len(entries)
    benchmark.extra_info["bytes"] = sum(len(v) for _, v in entries)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("subject", ["FileStorage", "raw files"])
def test_file_put(benchmark, tmp_path, size: str, subject: str) -> None:
    entries = _entries(size)
    _tag(benchmark, f"file-put-{size}", subject, entries)
    if subject == "FileStorage":
        storage = FileStorage(tmp_path)
        assert benchmark(storage.put, entries) == len(entries)
    else:
        paths = [tmp_path / key for key, _ in entries]

        def write() -> None:
            for path, (_, value) in zip(paths, entries):
                with open(path, "wb") as handle:
                    handle.write(value)

        benchmark(write)
        assert all(p.stat().st_size == len(entries[0][1]) for p in paths)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("subject", ["FileStorage", "raw files"])
def test_file_get(benchmark, tmp_path, size: str, subject: str) -> None:
    entries = _entries(size)
    _tag(benchmark, f"file-get-{size}", subject, entries)
    storage = FileStorage(tmp_path)
    storage.put(entries)
    if subject == "FileStorage":
        keys = [key for key, _ in entries]
        values = benchmark(storage.get, keys)
    else:
        paths = [storage._file(key) for key, _ in entries]

        def read() -> list[bytes]:
            out = []
            for path in paths:
                with open(path, "rb") as handle:
                    out.append(handle.read())
            return out

        values = benchmark(read)
    assert all(v == entries[0][1] for v in values)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("subject", ["RedisStorage", "raw pipeline"])
@pytest.mark.parametrize("op", ["put", "get"])
def test_redis(benchmark, redis_url, size: str, subject: str, op: str) -> None:
    import redis

    entries = _entries(size)
    _tag(benchmark, f"redis-{op}-{size}", subject, entries)
    prefix = f"bench-{os.getpid()}:"
    storage = RedisStorage(redis_url, prefix=prefix, socket_timeout=10)
    client = redis.Redis.from_url(redis_url)
    names = [prefix + key for key, _ in entries]
    storage.put(entries)
    try:
        if op == "put" and subject == "RedisStorage":
            assert benchmark(storage.put, entries) == len(entries)
        elif op == "put":

            def raw_put() -> None:
                pipe = client.pipeline(transaction=False)
                for name, (_, value) in zip(names, entries):
                    pipe.set(name, value)
                pipe.execute()

            benchmark(raw_put)
        elif subject == "RedisStorage":
            values = benchmark(storage.get, [key for key, _ in entries])
            assert values[0] == entries[0][1]
        else:
            values = benchmark(client.mget, names)
            assert values[0] == entries[0][1]
    finally:
        client.delete(*names)
        client.close()
        storage.close()
