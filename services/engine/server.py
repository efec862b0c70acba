"""Engine host entry point: vLLM AsyncLLM + gRPC server + metrics.

Start-up order: load the engine (slow), then open the gRPC port and report
SERVING on grpc.health.v1, so a ready port means a ready engine. On SIGTERM or
SIGINT: report NOT_SERVING, refuse new requests, let in-flight ones finish for
the grace period, abort the rest (which frees their KV); a prefill engine then
waits, within the same grace period, until every KV lease it holds is pulled or
released (services/engine/leases.py); then stop.

An engine that fails stops the host with exit status 1, so its supervisor
(Kubernetes, `tandem up`) sees it: when vLLM's engine core dies, or when it
stalls, that is, takes no engine step for ``--stall-timeout-s`` while requests
are in flight (a worker hung inside a model step keeps the engine core alive
and its health check passing; vLLM itself gives up only after
VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s by default). The host then reports
NOT_SERVING and ends every request in flight with UNAVAILABLE at once,
without a drain: the engine will finish none of them, and the router retries
them on another pod.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from common.logs import setup_logging
from common.proto import engine_pb2_grpc as pb_grpc
from common.roles import Role
from common.tls import TlsFiles
from services.engine import leases
from services.engine.config import EngineSettings, describe, parse_settings
from services.engine.load import LoadTracker
from services.engine.metrics import EngineMetrics
from services.engine.servicer import EngineServicer

log = logging.getLogger(__name__)
SERVICE_NAME = "tandem.engine.v1.Engine"
_HEALTH_PERIOD_S = 5.0


def _build_engine(settings: EngineSettings, load: LoadTracker):
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    # The NIXL side channel is configured through vLLM's environment; the
    # engine core process inherits it.
    os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", settings.host)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(settings.nixl_port)
    ea = settings.engine_args
    device = "cpu" if current_platform.is_cpu() else "cuda"
    # Read by services/engine/vllm_plugin.py in the engine core and worker.
    os.environ.update(settings.plugin_env(device))
    if ea.kv_transfer_config is None:
        cfg = settings.kv_transfer_config(device)
        if cfg is not None:
            ea.kv_transfer_config = KVTransferConfig(**cfg)
    if settings.role == Role.PREFILL and not ea.worker_extension_cls:
        ea.worker_extension_cls = leases.EXTENSION  # SIGTERM waits for its KV leases
    return AsyncLLM.from_engine_args(ea, stat_loggers=[load.stat_logger_factory()])


async def serve(settings: EngineSettings) -> int:
    """Serve until SIGTERM/SIGINT (0) or until the engine fails (1)."""
    load = LoadTracker()
    metrics = EngineMetrics(settings.role)
    start_http_server(settings.metrics_port, addr=settings.host)
    log.info("loading engine %s", describe(settings))
    engine = _build_engine(settings, load)
    ea = settings.engine_args
    metrics.describe_scheduler(engine.vllm_config.scheduler_config)
    metrics.watch_progress(lambda: load.seconds_without_progress(time.monotonic()))
    servicer = EngineServicer(
        engine, settings.role, ea.model, ea.served_model_name[0], load, metrics
    )

    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
        ]
    )
    pb_grpc.add_EngineServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{settings.host}:{settings.grpc_port}"
    # With TLS on the port speaks only TLS and requires a client certificate.
    bound = (
        server.add_secure_port(address, TlsFiles(settings.tls).server_credentials())
        if settings.tls.enabled
        else server.add_insecure_port(address)
    )
    if bound == 0:
        raise SystemExit(f"--grpc-port {settings.grpc_port}: cannot listen on {address}")
    await server.start()

    async def set_health(status) -> None:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)

    await set_health(health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "engine ready: role=%s grpc=%s metrics=http://%s:%d/metrics",
        settings.role,
        address,
        settings.host,
        settings.metrics_port,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def fail() -> None:
        """The engine failed: stop at once, failing what is in flight (also mid-drain)."""
        reason, message = await watch_engine(engine, load, settings.stall_timeout_s)
        log.error("failing %d request(s) in flight and stopping: %s", load.in_flight, message)
        await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        servicer.fail_all(reason, message)
        stop.set()

    watcher = asyncio.create_task(fail())
    await stop.wait()
    servicer.draining = True
    await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    if not servicer.failed:
        log.info(
            "shutting down: draining in-flight requests (up to %.0fs)", settings.shutdown_grace_s
        )
        deadline = time.monotonic() + settings.shutdown_grace_s
        # Ends early if the watcher fails every request meanwhile.
        if not await servicer.wait_idle(settings.shutdown_grace_s):
            log.warning("grace period over: aborting remaining requests")
            await servicer.abort_all()
            await servicer.wait_idle(5)
        elif ea.worker_extension_cls == leases.EXTENSION and not servicer.failed:
            # A decode may still be pulling KV this prefill computed.
            await leases.wait_kv_leases(engine, max(0.0, deadline - time.monotonic()))
    watcher.cancel()
    if servicer.failed:  # the failed requests' callers hear why before the port closes
        await servicer.wait_idle(5)
    await server.stop(grace=2)
    engine.shutdown()
    log.info("engine stopped")
    return 1 if servicer.failed else 0


async def watch_engine(
    engine: Any, load: LoadTracker, stall_timeout_s: float, period_s: float = _HEALTH_PERIOD_S
) -> tuple[str, str]:
    """Wait until the engine fails; returns (metric reason, message): its
    engine core died, or it stalled (``LoadTracker.stalled``)."""
    while True:
        try:
            await engine.check_health()
        except Exception as exc:  # an engine that died cannot recover here
            return "engine_dead", f"engine dead: {exc}"
        now = time.monotonic()
        if load.stalled(now, stall_timeout_s):
            return "engine_stalled", (
                f"engine stalled: no engine step for {load.seconds_without_progress(now):.0f}s "
                f"with {load.in_flight} request(s) in flight (--stall-timeout-s "
                f"{stall_timeout_s:g})"
            )
        await asyncio.sleep(period_s)


def main(argv: list[str] | None = None, default_role: Role | None = None) -> int:
    setup_logging(f"engine-{default_role or 'host'}")
    settings = parse_settings(sys.argv[1:] if argv is None else argv, default_role)
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
