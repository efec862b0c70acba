"""Fixtures of the router tests."""

from __future__ import annotations

import pytest

from bench.harness import RedisServer
from tests.router.fuzz_helpers import live_router


@pytest.fixture
def redis_servers(tmp_path):
    """Makes RedisServer objects (not yet started); kills them after the test."""
    made: list[RedisServer] = []

    def make() -> RedisServer:
        made.append(RedisServer(tmp_path))
        return made[-1]

    yield make
    for server in made:
        server.kill()


@pytest.fixture
def redis_server(redis_servers):
    """A real redis-server on a free loopback port, killed after the test.
    No redis-server: the test errors (RuntimeError), it never skips."""
    server = redis_servers()
    server.start()
    return server


@pytest.fixture(scope="session")
def fuzz_router(tmp_path_factory):
    """The real router process before one fake engine (fuzz_helpers.py), shared
    by the fuzz tests; bodies time out after 2 s so a slow-loris test is short."""
    with live_router(tmp_path_factory.mktemp("fuzz-router"), "--body-timeout-s", "2") as live:
        yield live
