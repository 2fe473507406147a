"""Shared test settings and fixtures (the helpers tests share are in tests/support/)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# No per-example deadline: CI machines are shared and slow at times; a slow example is not a failure.
settings.register_profile("kvblocks", deadline=None, print_blob=True)
settings.load_profile("kvblocks")


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis server: $KVBLOCKS_TEST_REDIS_URL, else one started here. Under CI=true it must exist."""
    url = os.environ.get("KVBLOCKS_TEST_REDIS_URL")
    if url:
        yield url
        return
    from .support.redis_server import RedisServer

    try:
        server = RedisServer().start()
    except (FileNotFoundError, RuntimeError) as error:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but no Redis server is available: {error}")
        pytest.skip(f"no Redis server ({error}); install redis-server or set KVBLOCKS_TEST_REDIS_URL")
    yield server.url
    server.stop()


@pytest.fixture
def private_redis():
    """A Redis server of the test's own, which it may kill and restart."""
    from .support.redis_server import RedisServer

    try:
        server = RedisServer().start()
    except (FileNotFoundError, RuntimeError) as error:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but redis-server cannot be started: {error}")
        pytest.skip(f"no redis-server to start ({error})")
    yield server
    server.stop()


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``cuda`` skip, saying so, where no CUDA GPU is visible."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
