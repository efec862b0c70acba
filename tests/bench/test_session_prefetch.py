"""bench.session_prefetch's pure parts: the gap before each turn, the
engines' and the router's counters, the rows and the on/off table."""

from __future__ import annotations

import pytest

from bench.router_ab import replay_order
from bench.session_prefetch import (
    counters,
    prefetch_counts,
    summarize,
    tables,
    with_gaps,
)

ENGINE_TEXT = """\
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 300.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 500.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 200.0
# TYPE vllm:mooncake_store_operation_bytes counter
vllm:mooncake_store_operation_bytes_total{engine="0",operation="load_get",status="ok"} 6e6
vllm:mooncake_store_operation_bytes_total{engine="0",operation="save_put",status="ok"} 9e6
vllm:mooncake_store_operation_bytes_total{engine="0",operation="save_exists",status="ok"} 1.0
"""

ROUTER_TEXT = """\
# TYPE tandem_router_prefetches counter
tandem_router_prefetches_total{outcome="started"} 3.0
tandem_router_prefetches_total{outcome="completed"} 2.0
tandem_router_prefetches_total{outcome="cancelled"} 1.0
# TYPE tandem_router_prefetch_tokens counter
tandem_router_prefetch_tokens_total 1536.0
"""


def test_engine_counters_by_source_and_operation():
    c = counters(ENGINE_TEXT)
    assert (c["prompt_tokens"], c["computed_tokens"], c["local_hit_tokens"], c["store_tokens"]) == (
        1000,
        300,
        500,
        200,
    )
    assert c["store_get_bytes"] == 6e6 and c["store_put_bytes"] == 9e6
    assert c["generation_tokens"] == 0  # absent: zero, not missing


def test_prefetch_counts():
    assert prefetch_counts(ROUTER_TEXT) == {
        "started": 3,
        "completed": 2,
        "cancelled": 1,
        "failed": 0,
        "tokens": 1536,
    }


def rec(session, agent, start, e2e, ttft=0.5, prompt=1000, cached=900, ok=True):
    return {
        "session": session,
        "agent": agent,
        "start": start,
        "e2e": e2e,
        "ttft": ttft,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ok": ok,
    }


def test_gap_is_the_agents_idle_time_since_its_previous_response():
    records = [
        rec("s", "", 0.0, 2.0),
        rec("s", "sa1", 3.0, 1.0),
        rec("s", "", 10.0, 1.0),
        rec("t", "", 4.0, 1.0, ok=False) | {"e2e": None},
        rec("t", "", 20.0, 1.0),
    ]
    gaps = {(r["session"], r["agent"], r["start"]): r["gap"] for r in with_gaps(records)}
    assert gaps[("s", "", 0.0)] is None  # first turn
    assert gaps[("s", "sa1", 3.0)] is None  # a sub-agent is its own session
    assert gaps[("s", "", 10.0)] == pytest.approx(8.0)
    assert gaps[("t", "", 20.0)] is None  # after a failed request: unknown


def run(label, records, prefetch=None, **engines):
    return {
        "label": label,
        "records": records,
        "summary": {"duration_s": 30.0},
        "prefetch": {
            "started": 0,
            "completed": 0,
            "cancelled": 0,
            "failed": 0,
            "tokens": 0,
            **(prefetch or {}),
        },
        "engines": {
            "prompt_tokens": 0,
            "computed_tokens": 0,
            "local_hit_tokens": 0,
            "store_tokens": 0,
            "generation_tokens": 0,
            "requests": 0,
            "store_get_bytes": 0,
            "store_put_bytes": 0,
            **engines,
        },
    }


def test_rows_and_ratios():
    off = [
        rec("s", "", 0.0, 1.0, ttft=1.0),
        rec("s", "", 10.0, 1.0, ttft=2.0, cached=0),
        rec("s", "", 12.0, 1.0, ttft=0.2),
    ]  # a 1 s gap: not "after a gap"
    on = [
        rec("s", "", 0.0, 1.0, ttft=1.0),
        rec("s", "", 10.0, 1.0, ttft=0.5, cached=900),
        rec("s", "", 12.0, 1.0, ttft=0.2),
    ]
    rows = [
        summarize("off", [run("off", off, prompt_tokens=3000, computed_tokens=2000)], 5.0),
        summarize(
            "on",
            [
                run(
                    "on",
                    on,
                    {"started": 1, "completed": 1, "tokens": 900},
                    prompt_tokens=4000,
                    computed_tokens=2100,
                )
            ],
            5.0,
        ),
    ]
    off_row, on_row = rows
    assert off_row["gap_turns"] == 1 and off_row["gap_ttft_p50"] == 2.0
    assert off_row["gap_cached_share"] == 0.0 and on_row["gap_cached_share"] == 0.9
    assert on_row["prefetch"]["completed"] == 1
    text = "\n".join(tables(rows, 5.0))
    assert "gap_ttft_p50 0.25×" in text
    assert "engine prompt_tokens 1.33×" in text
    assert "| on | 1 | 1 | 0 | 0 | 900 |" in text


def test_order_alternates():
    assert replay_order("off", 2) == ["off", "on", "on", "off"]
    assert replay_order("on", 1) == ["on", "off"]
