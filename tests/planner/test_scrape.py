"""Demand from the routers' counters: the window arithmetic (pure), and the
scrape of a real router process (``python -m services.router``) in front of a
fake gRPC engine (bench/router_fakes.py, fixed latency) over real HTTP. No
mocks."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from bench.router_fakes import MODEL_NAME
from operators.planner.demand import (
    PoolCounters,
    RouterSample,
    demand_of,
    measurements_of,
    window,
)
from operators.planner.scrape import RouterScrapeSource


def test_window_sums_replicas_and_survives_a_restart():
    a0 = RouterSample(0.0, {"prefill": PoolCounters(10, 10_000, 6_000, 0, 0, 5.0),
                            "decode": PoolCounters(0, 0, 0, 10, 1000, 20.0)})
    b0 = RouterSample(0.5, {"decode": PoolCounters(0, 0, 0, 4, 400, 8.0)})
    a1 = RouterSample(10.0, {"prefill": PoolCounters(30, 30_000, 18_000, 0, 0, 15.0),
                             "decode": PoolCounters(0, 0, 0, 30, 3000, 60.0)})
    # Replica b restarted (its decode counters went down): they count from zero.
    b1 = RouterSample(10.5, {"prefill": PoolCounters(5, 5_000, 0, 0, 0, 2.0),
                             "decode": PoolCounters(0, 0, 0, 3, 300, 6.0)})
    w = window({"a": a0, "b": b0}, {"a": a1, "b": b1})
    assert w.seconds == 10.0
    assert w.pools["prefill"] == PoolCounters(25, 25_000, 12_000, 0, 0, 12.0)
    assert w.pools["decode"] == PoolCounters(0, 0, 0, 23, 2300, 46.0)
    d = demand_of(w)
    assert d.request_rate == pytest.approx(2.3)
    assert d.mean_input_tokens == pytest.approx(1000)
    assert d.mean_output_tokens == pytest.approx(100)
    assert d.hit_rate == pytest.approx(12_000 / 25_000)
    m = {x.role: x for x in measurements_of(w, {"prefill": 2, "decode": 1})}
    assert m["prefill"].in_flight == pytest.approx(12.0 / 10 / 2)
    assert m["prefill"].uncached_tokens_per_s == pytest.approx(13_000 / 10 / 2)
    assert m["prefill"].requests == 25
    assert m["decode"].output_tokens_per_s == pytest.approx(230)
    assert m["decode"].in_flight == pytest.approx(4.6)


def test_nothing_finished_is_no_demand():
    s = RouterSample(0.0, {"decode": PoolCounters()})
    w = window({"a": s}, {"a": RouterSample(5.0, {"decode": PoolCounters()})})
    assert demand_of(w) is None
    assert window({}, {"a": s}) is None


async def test_scraping_a_real_router_gives_the_demand_it_served(fake_router):
    router = fake_router
    source = RouterScrapeSource([router])
    try:
        assert await source.window(time.monotonic()) is None  # the first round only samples
        start = time.monotonic()
        async with httpx.AsyncClient(base_url=router, timeout=30) as client:
            async def one(i: int) -> dict:
                r = await client.post("/v1/chat/completions", json={
                    "model": MODEL_NAME, "max_tokens": 5,
                    "messages": [{"role": "user", "content": f"question {i} " * (i + 1)}]})
                assert r.status_code == 200, r.text
                return r.json()["usage"]

            usages = await asyncio.gather(*(one(i) for i in range(8)))
        w = await source.window(time.monotonic())
        elapsed = time.monotonic() - start
    finally:
        await source.aclose()
    pool = w.pools["aggregated"]  # the fake engine is an aggregated ("both") pod
    assert pool.generations == 8 and pool.prompts == 8
    assert pool.prompt_tokens == sum(u["prompt_tokens"] for u in usages)
    assert pool.output_tokens == 8 * 5
    # Each request spends ≥ 200 + 4 × 20 ms in its Generate call.
    assert 8 * 0.28 <= pool.busy_seconds <= 8 * elapsed
    d = demand_of(w)
    assert d.mean_output_tokens == 5
    assert d.mean_input_tokens == pytest.approx(pool.prompt_tokens / 8)
    assert d.hit_rate == 0.0  # the fake engine reports no cached tokens
    m = measurements_of(w, {"aggregated": 1})[0]
    assert m.in_flight == pytest.approx(pool.busy_seconds / w.seconds)
