"""Engine pods as the router sees them: a gRPC channel each, health and load
refreshed by polling, and the router's own exact in-flight count per pod.

Which pod serves a request is the routing core's choice
(`services/router/routing`); the pool feeds it every poll result
(`RoutingCore.update_pod`) and every pod the request path saw fail.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc
from services.router.metrics import RouterMetrics
from services.router.routing import RoutingCore
from services.router.routing.tasks import cancel_and_wait

log = logging.getLogger("tandem.router")

_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                    ("grpc.max_send_message_length", 64 << 20),
                    ("grpc.keepalive_time_ms", 10_000),
                    ("grpc.keepalive_timeout_ms", 5_000)]


# Consecutive timed-out polls after which a pod counts as unhealthy.
_SLOW_POLLS_BEFORE_UNHEALTHY = 3


@dataclass
class PodState:
    healthy: bool = False
    draining: bool = False
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    kv_capacity_blocks: int = 0  # 0: not reported
    in_flight: int = 0  # the router's own count: exact, no polling lag


class EnginePod:
    def __init__(self, address: str, role: str, metrics: RouterMetrics) -> None:
        self.address = address
        self.role = role  # "prefill", "decode" or "both"
        self.channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self.stub = pb_grpc.EngineStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.state = PodState()
        self._metrics = metrics
        self._slow_polls = 0

    @property
    def available(self) -> bool:
        return self.state.healthy and not self.state.draining

    def acquire(self) -> None:
        self.state.in_flight += 1
        self._metrics.pod_in_flight.labels(self.address, self.role).set(self.state.in_flight)

    def release(self) -> None:
        self.state.in_flight -= 1
        self._metrics.pod_in_flight.labels(self.address, self.role).set(self.state.in_flight)

    def mark_unhealthy(self, why: str) -> None:
        if self.state.healthy:
            log.warning("pod %s (%s) marked unhealthy: %s", self.address, self.role, why)
        self.state.healthy = False
        self._metrics.pod_healthy.labels(self.address, self.role).set(0)

    async def poll(self, timeout: float) -> None:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""),
                                             timeout=timeout)
            load = await self.stub.GetLoad(pb.GetLoadRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            # A refused connection is a dead pod; a slow answer from a busy
            # one is not, unless it keeps happening.
            self._slow_polls += 1
            if (exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED
                    or self._slow_polls >= _SLOW_POLLS_BEFORE_UNHEALTHY):
                self.mark_unhealthy(exc.code().name)
            return
        self._slow_polls = 0
        healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
        if healthy and not self.state.healthy:
            log.info("pod %s (%s) is healthy", self.address, self.role)
        if not healthy:
            self.mark_unhealthy("health check says NOT_SERVING")
        self.state.healthy = healthy
        self.state.draining = load.draining
        self.state.waiting, self.state.running = load.waiting, load.running
        self.state.kv_cache_usage = load.kv_cache_usage
        self.state.kv_capacity_blocks = load.kv_capacity_blocks
        self._metrics.pod_healthy.labels(self.address, self.role).set(int(healthy))

    async def model_info(self, timeout: float) -> pb.GetModelInfoResponse:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()


class PodPool:
    def __init__(self, pods: list[EnginePod], poll_interval_s: float,
                 core: RoutingCore) -> None:
        self.pods = pods
        self.core = core
        self._by_address = {p.address: p for p in pods}
        self._poll_interval_s = poll_interval_s
        self._poller: asyncio.Task | None = None

    def of_role(self, *roles: str) -> list[EnginePod]:
        return [p for p in self.pods if p.role in roles]

    def pod(self, address: str) -> EnginePod:
        return self._by_address[address]

    def mark_failed(self, address: str, why: str) -> None:
        """A call to the pod failed before its first byte: no new work until a
        poll finds it healthy again."""
        pod = self._by_address[address]
        pod.mark_unhealthy(why)
        self._report(pod)

    def _report(self, pod: EnginePod) -> None:
        st = pod.state
        self.core.update_pod(pod.address, time.monotonic(), healthy=st.healthy,
                             draining=st.draining, running=st.running, waiting=st.waiting,
                             kv_cache_usage=st.kv_cache_usage,
                             kv_capacity_blocks=st.kv_capacity_blocks)

    async def _poll(self, pod: EnginePod) -> None:
        await pod.poll(timeout=max(3 * self._poll_interval_s, 3.0))
        self._report(pod)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(p) for p in self.pods))

    async def _poll_forever(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self._poll_interval_s)

    def start(self) -> None:
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        # The poller ends before the channels it polls through close.
        await cancel_and_wait(self._poller)
        self._poller = None
        await asyncio.gather(*(p.close() for p in self.pods), return_exceptions=True)
