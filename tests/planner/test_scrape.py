"""Demand from the routers' counters: the window arithmetic (pure), and the
scrape of a real router process (``python -m services.router``) in front of a
fake gRPC engine (bench/router_fakes.py, fixed latency) over real HTTP. No
mocks."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client import generate_latest

from bench.router_fakes import MODEL_NAME
from operators.planner.demand import (
    PoolCounters,
    RouterSample,
    ScrapeHistory,
    demand_of,
    measurements_of,
    window,
)
from operators.planner.scrape import RouterScrapeSource
from services.router.metrics import RouterMetrics


def test_window_sums_replicas_and_survives_a_restart():
    a0 = RouterSample(
        0.0,
        {
            "prefill": PoolCounters(10, 10_000, 6_000, 0, 0, 5.0),
            "decode": PoolCounters(0, 0, 0, 10, 1000, 20.0),
        },
    )
    b0 = RouterSample(0.5, {"decode": PoolCounters(0, 0, 0, 4, 400, 8.0)})
    a1 = RouterSample(
        10.0,
        {
            "prefill": PoolCounters(30, 30_000, 18_000, 0, 0, 15.0),
            "decode": PoolCounters(0, 0, 0, 30, 3000, 60.0),
        },
    )
    # Replica b restarted (its decode counters went down): they count from zero.
    b1 = RouterSample(
        10.5,
        {
            "prefill": PoolCounters(5, 5_000, 0, 0, 0, 2.0),
            "decode": PoolCounters(0, 0, 0, 3, 300, 6.0),
        },
    )
    w = window([{"a": a0, "b": b0}, {"a": a1, "b": b1}])
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
    w = window([{"a": s}, {"a": RouterSample(5.0, {"decode": PoolCounters()})}])
    assert demand_of(w) is None
    assert window([{}, {"a": s}]) is None
    assert window([]) is None


def decoded(at: float, generations: float) -> RouterSample:
    return RouterSample(at, {"decode": PoolCounters(generations=generations)})


def test_a_window_spans_its_rounds_and_a_restart_loses_one_interval_at_most():
    rounds = [{"a": decoded(0.0, 100)}, {"a": decoded(15.0, 130)}, {"a": decoded(30.0, 160)}]
    # Restarted between the third round and the fourth: counts from zero there.
    rounds.append({"a": decoded(45.0, 25)})
    w = window(rounds)
    assert w.seconds == 45.0
    assert w.pools["decode"].generations == 30 + 30 + 25


def test_the_history_gives_a_window_once_it_spans_its_intervals():
    history = ScrapeHistory(intervals=2)
    history = history.add({"a": decoded(0.0, 0), "b": decoded(0.0, 0)}, {"a", "b"})
    history = history.add({"a": decoded(10.0, 10), "b": decoded(10.0, 5)}, {"a", "b"})
    assert history.window() is None
    # b does not answer: it keeps its last sample. c is new: it counts from zero.
    history = history.add({"a": decoded(20.0, 20), "c": decoded(20.0, 4)}, {"a", "b", "c"})
    w = history.window()
    assert w.seconds == 20.0 and w.pools["decode"].generations == 20 + 5 + 4
    # The oldest round drops out; b, gone from the replicas, is forgotten.
    history = history.add({"a": decoded(30.0, 30), "c": decoded(30.0, 8)}, {"a", "c"})
    w = history.window()
    assert len(history.rounds) == 3
    assert w.seconds == 20.0 and w.pools["decode"].generations == 20 + 4 + 4


async def test_scraping_a_real_router_gives_the_demand_it_served(fake_router):
    router = fake_router
    source = RouterScrapeSource([router], intervals=1)
    try:
        assert await source.window(time.monotonic()) is None  # the first round only samples
        start = time.monotonic()
        async with httpx.AsyncClient(base_url=router, timeout=30) as client:

            async def one(i: int) -> dict:
                r = await client.post(
                    "/v1/chat/completions",
                    json={
                        "model": MODEL_NAME,
                        "max_tokens": 5,
                        "messages": [{"role": "user", "content": f"question {i} " * (i + 1)}],
                    },
                )
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


class RouterStandIns:
    """Router ``/metrics`` over real HTTP, counted by the router's own metric
    definitions: each answer adds 7 finished decode requests. Before answering,
    every stand-in waits at ``barrier`` when set, and those in ``stalled``
    until ``release`` is set."""

    def __init__(self, n: int) -> None:
        self.barrier: threading.Barrier | None = None
        self.stalled: set[str] = set()
        self.release = threading.Event()
        self.servers = []
        stand_ins = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = f"http://127.0.0.1:{self.server.server_address[1]}"
                if url in stand_ins.stalled:  # answers only after the scrape gave up
                    stand_ins.release.wait(10)
                    self.send_error(503, "too late")
                    return
                try:
                    if stand_ins.barrier is not None:
                        stand_ins.barrier.wait()
                except threading.BrokenBarrierError:
                    self.send_error(500, "asked one at a time")
                    return
                metrics = self.server.metrics  # type: ignore[attr-defined]
                metrics.pool_generations.labels("decode").inc(7)
                body = generate_latest(metrics.registry)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        for _ in range(n):
            server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            server.metrics = RouterMetrics()  # type: ignore[attr-defined]
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers.append(server)
        self.urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in self.servers]

    def stop(self) -> None:
        self.release.set()
        for s in self.servers:
            s.shutdown()
            s.server_close()


@pytest.fixture
def stand_ins():
    routers = RouterStandIns(3)
    yield routers
    routers.stop()


async def test_router_pods_are_scraped_at_once(stand_ins):
    # Each answer waits until all three routers are asked: scraped one after
    # the other, the first would break the barrier and answer 500.
    source = RouterScrapeSource(stand_ins.urls, timeout_s=20, intervals=1)
    try:
        for _ in range(2):
            stand_ins.barrier = threading.Barrier(3, timeout=5)
            w = await source.window(time.monotonic())
            assert source.failures == {}
    finally:
        await source.aclose()
    assert w is not None and w.pools["decode"].generations == 3 * 7


async def test_a_slow_router_pod_does_not_hold_up_the_others(stand_ins):
    slow = stand_ins.urls[0]
    source = RouterScrapeSource(stand_ins.urls, timeout_s=0.5, intervals=1)
    try:
        await source.window(time.monotonic())
        stand_ins.stalled = {slow}
        w = await source.window(time.monotonic())
        assert source.failures == {slow: "no answer within 0.5 s"}
        assert w is not None and w.pools["decode"].generations == 2 * 7  # the two that answered
        # Back: it counts from its last sample.
        stand_ins.stalled = set()
        stand_ins.release.set()
        w = await source.window(time.monotonic())
    finally:
        await source.aclose()
    assert source.failures == {}
    assert w.pools["decode"].generations == 2 * 7 + 7  # the slow one's own window spans both
