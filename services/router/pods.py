"""Engine pods as the router reaches them: a gRPC channel each, health and
load polled, and the KV event stream of each pod that publishes one.

What the router knows of a pod (health, load, circuit breaker) lives in the
routing core (`routing.RoutingCore.pods`); the pool does the I/O that feeds it:
every poll result goes to `RoutingCore.update_pod`, every KV event batch into
its prefix index. The pod set changes at runtime through `add_pod`,
`remove_pod` and `set_draining` (`discovery.py` says where pods come from).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.engine_stream import GenerateStreamClient
from common.proto import engine_pb2 as pb
from common.proto import engine_pb2_grpc as pb_grpc
from common.roles import Role
from common.tls import TlsFiles
from services.router.routing import PodSpec, RoutingCore
from services.router.routing.events import KvEventSubscriber
from services.router.routing.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]

# Consecutive timed-out polls after which a pod counts as unhealthy.
_SLOW_POLLS_BEFORE_UNHEALTHY = 3


# Old channels closing in the background after a certificate reload.
_closing: set[asyncio.Task[None]] = set()


def open_channel(
    address: str, credentials: grpc.ChannelCredentials | None, server_name: str | None = None
) -> grpc.aio.Channel:
    """A channel to an engine: mutual TLS with `credentials` (the engine's
    certificate checked against `server_name`, else the address), else plaintext."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
    options = list(_CHANNEL_OPTIONS)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(address, credentials, options=options)


class EnginePod:
    """One pod's connections: its gRPC channel (with, unless `shared_stream`
    is off, one GenerateStream carrying every generation on it) and, if it
    publishes them, its KV events."""

    def __init__(
        self,
        spec: PodSpec,
        events: KvEventSubscriber | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str | None = None,
        shared_stream: bool = True,
    ) -> None:
        self.spec = spec
        self._server_name = server_name
        self._shared_stream = shared_stream
        self._connect(credentials)
        self.events = events
        self.slow_polls = 0

    def _connect(self, credentials: grpc.ChannelCredentials | None) -> None:
        self.channel = open_channel(self.spec.name, credentials, self._server_name)
        self.stub = pb_grpc.EngineStub(self.channel)
        self.streams = GenerateStreamClient(self.stub) if self._shared_stream else None
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def generate(self, request: pb.GenerateRequest):
        """A Generate call (an async iterator of its messages, with cancel())."""
        if self.streams is not None:
            return self.streams.generate(request)
        return self.stub.Generate(request)

    def reconnect(self, credentials: grpc.ChannelCredentials, grace_s: float) -> None:
        """New calls go over a new channel with `credentials`; the old one
        closes once its calls end (at most `grace_s` later)."""
        old = self.channel
        if self.streams is not None:
            self.streams.close_when_idle()
        self._connect(credentials)
        task = asyncio.get_running_loop().create_task(old.close(grace_s))
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    @property
    def address(self) -> str:
        return self.spec.name

    @property
    def role(self) -> Role:
        return self.spec.role

    async def check(self, timeout: float) -> tuple[bool, pb.GetLoadResponse]:
        """(serving, load) from the pod's health service and GetLoad."""
        reply = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        load = await self.stub.GetLoad(pb.GetLoadRequest(), timeout=timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING, load

    async def close(self, grace_s: float | None = None) -> None:
        """Stop its KV events at once, then close the channel once its calls
        end (or after ``grace_s``; None: now)."""
        if self.events is not None:
            await self.events.stop()
        if self.streams is not None:
            self.streams.close_when_idle()
        await self.channel.close(grace_s)


class PodPool:
    def __init__(
        self,
        core: RoutingCore,
        poll_interval_s: float,
        remove_grace_s: float = 30.0,
        tls: TlsFiles | None = None,
        shared_streams: bool = True,
    ) -> None:
        self.core = core
        self._shared_streams = shared_streams
        # Mutual TLS to the engines: the files are checked at each poll and
        # every channel is reopened when they change.
        self._tls = tls
        self._credentials = tls.channel_credentials() if tls is not None else None
        self._pods: dict[str, EnginePod] = {}
        self._poll_interval_s = poll_interval_s
        self._remove_grace_s = remove_grace_s
        self._poller: asyncio.Task[None] | None = None

    # ----- the pod set ------------------------------------------------------
    def add_pod(self, spec: PodSpec) -> EnginePod:
        """Connect to a new pod (and its KV events). It gets work once a poll
        finds it healthy: at the next round, within the poll interval."""
        if spec.name in self._pods:
            raise ValueError(f"pod {spec.name} is already in the pool")
        self.core.add_pod(spec)
        events = None
        if spec.kv_events:
            events = KvEventSubscriber(
                spec.name, spec.kv_events, spec.kv_events_replay, self.core.index
            )
            events.start()
        pod = self._pods[spec.name] = EnginePod(
            spec,
            events,
            self._credentials,
            self._tls.server_name if self._tls else None,
            self._shared_streams,
        )
        log.info(
            "pod %s (%s) added%s",
            spec.name,
            spec.role,
            f", KV events from {spec.kv_events}" if spec.kv_events else "",
        )
        return pod

    async def remove_pod(self, name: str) -> None:
        """The pod is gone: no new work from now on; its KV events stop at once
        (none reach the index after), its channel closes once the calls on it
        end, at most ``remove_grace_s`` later."""
        pod = self._pods.pop(name)
        self.core.remove_pod(name)
        log.info("pod %s (%s) removed", name, pod.role)
        await pod.close(self._remove_grace_s)

    def set_draining(self, name: str, draining: bool = True) -> None:
        """The pod is going away: no new requests while its streams finish."""
        self.core.set_draining(name, draining)

    @property
    def pods(self) -> list[EnginePod]:
        return list(self._pods.values())

    def get(self, name: str) -> EnginePod | None:
        """The pod, or None if it was removed."""
        return self._pods.get(name)

    def of_role(self, *roles: Role) -> list[EnginePod]:
        return [p for p in self._pods.values() if p.role in roles]

    # ----- polls ------------------------------------------------------------
    async def _poll(self, pod: EnginePod) -> None:
        try:
            serving, load = await pod.check(timeout=max(3 * self._poll_interval_s, 3.0))
        except grpc.aio.UsageError:
            return  # the pod was removed meanwhile: its channel is closed
        except grpc.aio.AioRpcError as exc:
            # A refused connection is a dead pod; a slow answer from a busy
            # one is not, unless it keeps happening.
            pod.slow_polls += 1
            if (
                exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED
                or pod.slow_polls >= _SLOW_POLLS_BEFORE_UNHEALTHY
            ):
                self.core.mark_unhealthy(pod.address, exc.code().name)
            return
        pod.slow_polls = 0
        self.core.update_pod(
            pod.address,
            time.monotonic(),
            healthy=serving,
            draining=load.draining,
            running=load.running,
            waiting=load.waiting,
            kv_cache_usage=load.kv_cache_usage,
            kv_capacity_blocks=load.kv_capacity_blocks,
            why="" if serving else "health check says NOT_SERVING",
        )

    async def poll_once(self) -> None:
        self.reload_tls()
        await asyncio.gather(*(self._poll(p) for p in self.pods))

    def reload_tls(self) -> bool:
        """Reopen every pod's channel if the TLS files changed; whether they did."""
        if self._tls is None or not self._tls.changed():
            return False
        try:
            self._credentials = self._tls.channel_credentials()
        except OSError as exc:  # caught mid-replacement: the next poll tries again
            log.warning("TLS files changed but cannot be read yet: %s", exc)
            return False
        log.info("TLS files changed: reconnecting to %d pods with them", len(self._pods))
        for pod in self._pods.values():
            pod.reconnect(self._credentials, self._remove_grace_s)
        return True

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
