"""Session KV prefetch on the request path: real gRPC to fake engines from
bench/router_fakes.py in this process (no mocks); the decisions themselves are
tested in tests/router/routing/test_prefetch.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import generate_latest

from bench.router_fakes import Timing, start_grpc_server
from common.proto import engine_pb2 as pb
from services.router.metrics import RouterMetrics
from services.router.pd import EngineRequest, Orchestrator
from services.router.pods import PodPool
from services.router.prefetch import SessionPrefetcher
from services.router.routing import PodSpec, Replica, RoutingCore, RoutingSettings
from services.router.routing.prefetch import PrefetchSettings
from services.router.routing.shared_state import LocalState
from tests.helpers import metric_value

HOST = "127.0.0.1"
TOKENS = list(range(1, 201))


async def _fakes(first_token_ms: float):
    servers = [
        await start_grpc_server(HOST, 0, Timing(first_token_ms=first_token_ms, token_delay_ms=5))
        for _ in range(2)
    ]
    return servers, [f"{HOST}:{s.bound_port}" for s in servers]


class Router:
    def __init__(self, addresses: list[str]) -> None:
        self.core = RoutingCore(RoutingSettings(block_size=16))
        self.pool = PodPool(self.core, poll_interval_s=60)
        for address in addresses:
            self.pool.add_pod(PodSpec(address))
        self.metrics = RouterMetrics()
        self.state = LocalState()
        replica = Replica(self.core, self.state)
        self.prefetcher = SessionPrefetcher(
            PrefetchSettings(session_prefetch=True, prefetch_min_tokens=64),
            self.pool,
            replica,
            self.metrics,
            interval_s=60,
        )
        self.orchestrator = Orchestrator(
            self.pool, replica, self.metrics, prefetcher=self.prefetcher
        )

    async def turn(self, session: str) -> None:
        req = EngineRequest(
            request_id=f"r{time.perf_counter_ns()}",
            token_ids=TOKENS,
            sampling=pb.SamplingParams(max_tokens=2),
            cache_salt=None,
            arrival=time.perf_counter(),
            session=session,
        )
        [m async for m in self.orchestrator.stream(req)]

    def count(self, outcome: str) -> float:
        return metric_value(
            generate_latest(self.metrics.registry).decode(),
            "tandem_router_prefetches_total",
            f'outcome="{outcome}"',
        )

    async def close(self) -> None:
        await self.prefetcher.close()
        await self.pool.close()


async def _until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
async def router():
    servers, addresses = await _fakes(first_token_ms=5)
    r = Router(addresses)
    await r.pool.poll_once()
    yield r
    await r.close()
    await asyncio.gather(*(s.stop(grace=None) for s in servers))


async def test_a_session_that_will_move_is_warmed_on_its_next_pod(router):
    r = router
    await r.turn("s")
    binding = (await r.state.read("s", time.monotonic())).binding
    home = binding.pod
    assert await r.prefetcher.sweep() == []  # its KV is where its next turn goes
    r.pool.set_draining(home)  # the pod goes away: the next turn moves
    [p] = await r.prefetcher.sweep()
    assert p.pod != home and p.reason == "moves" and p.tokens == len(TOKENS)
    await _until(lambda: r.count("completed") == 1)
    assert r.count("started") == 1
    assert metric_value(
        generate_latest(r.metrics.registry).decode(), "tandem_router_prefetch_tokens_total"
    ) == len(TOKENS)
    now = time.monotonic()
    view = r.core.next_turn(r.core.hasher.event_hashes(TOKENS), len(TOKENS), "s", binding, now)
    assert (view.name, view.cached_tokens) == (p.pod, 192)  # warm there now
    assert await r.prefetcher.sweep() == []  # once per gap
    await r.turn("s")  # the next turn goes there
    assert (await r.state.read("s", time.monotonic())).binding.pod == p.pod


async def test_the_next_turn_cancels_a_running_prefetch():
    servers, addresses = await _fakes(first_token_ms=3000)
    r = Router(addresses)
    try:
        await r.pool.poll_once()
        r.prefetcher.turn_ended("s", TOKENS, None)  # as if a turn had run on the first pod
        r.core.live.touch("s", [addresses[0]], r.core.hasher.event_hashes(TOKENS), time.monotonic())
        r.pool.set_draining(addresses[0])
        [p] = await r.prefetcher.sweep()
        assert p.pod == addresses[1]
        await r.pool.poll_once()
        assert r.core.pods[p.pod].running == 1  # the engine runs it
        r.prefetcher.turn_started("s")
        await _until(lambda: r.count("cancelled") == 1)
        await asyncio.sleep(0.1)
        await r.pool.poll_once()
        assert r.core.pods[p.pod].running == 0  # the engine's request ended with it
        assert r.count("completed") == 0
    finally:
        await r.close()
        await asyncio.gather(*(s.stop(grace=None) for s in servers))


async def test_idle_sessions_are_bounded_as_live_sessions_are():
    core = RoutingCore(RoutingSettings(block_size=16, live_max_sessions=2))
    prefetcher = SessionPrefetcher(
        PrefetchSettings(session_prefetch=True),
        PodPool(core, poll_interval_s=60),
        Replica(core, LocalState()),
        RouterMetrics(),
        interval_s=60,
    )
    for session in "abc":
        prefetcher.turn_started(session)
        prefetcher.turn_ended(session, TOKENS, None)
    assert prefetcher.entries == 2 and prefetcher.evictions == 1
