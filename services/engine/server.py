"""Engine host entry point: vLLM AsyncLLM + gRPC server + metrics.

Start-up order: load the engine (slow), then open the gRPC port and report
SERVING on grpc.health.v1, so a ready port means a ready engine. On SIGTERM or
SIGINT: report NOT_SERVING, refuse new requests, let in-flight ones finish for
the grace period, abort the rest (which frees their KV); a prefill engine then
waits, within the same grace period, until every KV lease it holds is pulled or
released (services/engine/leases.py); then stop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from common.logs import setup_logging
from common.proto import engine_pb2_grpc as pb_grpc
from common.roles import Role
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


async def serve(settings: EngineSettings) -> None:
    load = LoadTracker()
    metrics = EngineMetrics(settings.role)
    start_http_server(settings.metrics_port, addr=settings.host)
    log.info("loading engine %s", describe(settings))
    engine = _build_engine(settings, load)
    ea = settings.engine_args
    metrics.describe_scheduler(engine.vllm_config.scheduler_config)
    servicer = EngineServicer(engine, settings.role, ea.model, ea.served_model_name[0],
                              load, metrics)

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    pb_grpc.add_EngineServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{settings.host}:{settings.grpc_port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"--grpc-port {settings.grpc_port}: cannot listen on {address}")
    await server.start()

    async def set_health(status) -> None:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)

    await set_health(health_pb2.HealthCheckResponse.SERVING)
    log.info("engine ready: role=%s grpc=%s metrics=http://%s:%d/metrics",
             settings.role, address, settings.host, settings.metrics_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def watch_engine() -> None:
        while not stop.is_set():
            try:
                await engine.check_health()
            except Exception as exc:  # an engine that died cannot recover here
                log.error("engine unhealthy, stopping: %s", exc)
                await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
                stop.set()
                return
            await asyncio.sleep(_HEALTH_PERIOD_S)

    watcher = asyncio.create_task(watch_engine())
    await stop.wait()
    watcher.cancel()

    log.info("shutting down: draining in-flight requests (up to %.0fs)",
             settings.shutdown_grace_s)
    deadline = time.monotonic() + settings.shutdown_grace_s
    servicer.draining = True
    await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    if not await servicer.wait_idle(settings.shutdown_grace_s):
        log.warning("grace period over: aborting remaining requests")
        await servicer.abort_all()
        await servicer.wait_idle(5)
    elif ea.worker_extension_cls == leases.EXTENSION:
        # A decode may still be pulling KV this prefill computed.
        await leases.wait_kv_leases(engine, max(0.0, deadline - time.monotonic()))
    await server.stop(grace=2)
    engine.shutdown()
    log.info("engine stopped")


def main(argv: list[str] | None = None, default_role: Role | None = None) -> int:
    setup_logging(f"engine-{default_role or 'host'}")
    settings = parse_settings(sys.argv[1:] if argv is None else argv, default_role)
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
