"""What the benchmarks and the test helpers share (bench/harness.py): CPU
counters and a real redis-server. Seconds."""

from __future__ import annotations

import os

from bench.harness import RedisServer, cpu_busy_seconds
from common.procs import group_cpu_seconds


def test_cpu_counters_read_proc():
    cpus = sorted(os.sched_getaffinity(0))
    busy = cpu_busy_seconds(cpus)
    assert set(busy) == set(cpus) and all(v > 0 for v in busy.values())
    assert group_cpu_seconds(os.getpgid(0)) > 0


def test_redis_server_starts_stops_and_comes_back_empty(tmp_path):
    import redis

    server = RedisServer(tmp_path)
    server.start()
    try:
        client = redis.Redis(port=server.port)
        client.set("k", "v")
        server.kill()
        assert not server.ping()
        server.start()  # same port, no persistence
        assert server.ping() and client.get("k") is None
        server.stop()
        assert not server.ping()
    finally:
        server.kill()
