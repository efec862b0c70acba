"""What the benchmarks and the test helpers share (bench/harness.py): the SSE
reader, percentiles, CPU counters and a real redis-server. Seconds."""

from __future__ import annotations

import os

import numpy as np
import pytest

from bench.harness import (
    RedisServer,
    cpu_busy_seconds,
    is_done,
    output_deltas,
    percentile,
    sse_data,
    urls,
)
from common.procs import group_cpu_seconds


def test_sse_data_reads_data_lines_of_text_and_bytes():
    assert sse_data('data: {"a":1}') == '{"a":1}'
    assert sse_data(b"data:[DONE]\n") == b"[DONE]"
    assert sse_data("") is None and sse_data(b"\n") is None
    assert sse_data(": keep-alive") is None and sse_data("event: x") is None
    assert is_done("[DONE]") and is_done(b"[DONE]") and not is_done("{}")


def test_output_deltas_count_choices_with_text():
    assert output_deltas({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == 0
    assert output_deltas({"choices": [{"delta": {"content": " a"}}]}) == 1
    assert output_deltas({"choices": [{"delta": {"reasoning_content": "hm"}},
                                      {"delta": {"content": "b"}}]}) == 2
    assert output_deltas({"choices": [], "usage": {"completion_tokens": 3}}) == 0


def test_percentile_interpolates_linearly_and_skips_missing():
    values = [0.3, 0.1, None, 0.4, 0.2]
    assert percentile(values, 50) == pytest.approx(0.25)
    assert percentile(values, 90) == pytest.approx(float(np.percentile([.1, .2, .3, .4], 90)))
    assert percentile([], 50) is None and percentile([None], 99) is None


def test_urls_split_replicas():
    assert urls("http://a:1, http://b:2,") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="no URL"):
        urls(" , ")


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
