"""The pod pool at runtime: pods added, drained and removed while the router
serves, as Kubernetes discovery will drive it. Real gRPC: fake engines from
bench/router_fakes.py serve in this process, each answering with its own
token text, so every answer says which pod served it. No mocks."""

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
from services.router.routing import PodSpec, Replica, RoutingCore, RoutingSettings
from services.router.routing.shared_state import LocalState

HOST = "127.0.0.1"


@pytest.fixture
async def engines():
    """Two fake engines, answering ' a' and ' b'; {text: address}."""
    servers, found = [], {}
    for text in (" a", " b"):
        server = await start_grpc_server(
            HOST, 0, Timing(first_token_ms=5, token_delay_ms=20), token_text=text
        )
        servers.append(server)
        found[text.strip()] = f"{HOST}:{server.bound_port}"
    yield found
    await asyncio.gather(*(s.stop(grace=None) for s in servers))


class Router:
    """The request path over a pool, as app.py wires it."""

    def __init__(self, state: LocalState | None = None) -> None:
        self.core = RoutingCore(RoutingSettings())
        self.pool = PodPool(self.core, poll_interval_s=60, remove_grace_s=10)
        self.metrics = RouterMetrics()
        self.state = state or LocalState()
        self.metrics.watch(self.core, self.pool, self.state)
        self.orchestrator = Orchestrator(self.pool, Replica(self.core, self.state), self.metrics)
        self._n = 0

    def stream(self, max_tokens: int = 2):
        self._n += 1
        return self.orchestrator.stream(
            EngineRequest(
                request_id=f"r{self._n}",
                token_ids=list(range(1, 50)),
                sampling=pb.SamplingParams(max_tokens=max_tokens),
                cache_salt=None,
                arrival=time.perf_counter(),
            )
        )

    async def served_by(self) -> str:
        return "".join([m.text async for m in self.stream()]).split()[0]

    def metrics_text(self) -> str:
        return generate_latest(self.metrics.registry).decode()


async def test_pods_added_drained_and_removed_while_serving(engines):
    r = Router()
    r.pool.add_pod(PodSpec(engines["a"]))
    await r.pool.poll_once()
    assert await r.served_by() == "a"
    r.pool.add_pod(PodSpec(engines["b"]))
    assert r.core.state_of(engines["b"], time.monotonic()) == "unhealthy"  # not polled yet
    await r.pool.poll_once()
    r.pool.set_draining(engines["a"])
    assert {await r.served_by() for _ in range(4)} == {"b"}
    text = r.metrics_text()
    assert f'pod="{engines["a"]}",role="both",state="draining"}} 1.0' in text
    await r.pool.remove_pod(engines["a"])
    assert list(r.core.pods) == [engines["b"]]
    assert engines["a"] not in r.metrics_text()  # its series left with it
    assert await r.served_by() == "b"
    await r.pool.close()


async def test_a_stream_on_a_removed_pod_finishes(engines):
    """Removal stops new work at once; a call already running ends normally."""
    r = Router()
    r.pool.add_pod(PodSpec(engines["a"]))
    await r.pool.poll_once()
    stream = r.stream(max_tokens=10)  # ~200 ms of tokens
    first = await anext(stream)
    removal = asyncio.create_task(r.pool.remove_pod(engines["a"]))
    rest = [m async for m in stream]
    assert [first.text] + [m.text for m in rest] == [" a"] * 10
    assert rest[-1].finish_reason == "length"
    await removal
    await r.pool.close()


class RemovesOnFirstWrite(LocalState):
    """A store whose first write (just after the first decision) coincides
    with discovery removing the pod that decision chose."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: PodPool | None = None
        self.removed: str | None = None

    async def write(self, writes, now):
        await super().write(writes, now)
        if self.removed is None and writes.loads:
            self.removed = next(iter(writes.loads))
            await self.pool.remove_pod(self.removed)


async def test_a_pod_removed_after_the_decision_is_routed_around(engines):
    state = RemovesOnFirstWrite()
    r = Router(state)
    state.pool = r.pool
    for address in engines.values():
        r.pool.add_pod(PodSpec(address))
    await r.pool.poll_once()
    served = await r.served_by()
    assert engines[served] != state.removed  # the other pod, with no error
    assert list(r.core.pods) == [engines[served]]
    assert r.core.local_load(engines[served]).in_flight == 0
    assert r.core.local_load(state.removed).in_flight == 0  # the first decision was freed
    await r.pool.close()
