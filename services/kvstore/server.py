"""KV store service entry point: validate, start Mooncake, serve HTTP, stop cleanly.

HTTP (``--http-port``): ``/health`` (200 when master and pool owner are both
ready, 503 with the failing process otherwise), ``/metrics`` (Prometheus,
see :mod:`services.kvstore.metrics`), ``/v1/engine-config`` (the JSON that
engines read, also written to ``<state-dir>/mooncake-engine.json``).

SIGTERM/SIGINT: mark unhealthy, stop the pool owner, then the master.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from common.logs import setup_logging
from common.mooncake import (
    KvStoreSettings,
    client_command,
    engine_store_config,
    find_binary,
    master_command,
)
from services.kvstore.metrics import StoreCollector, parse_master_metrics
from services.kvstore.settings import SettingError, parse_settings, validate
from services.kvstore.supervisor import (
    ManagedProcess,
    StartupError,
    Supervisor,
    http_ok,
    http_text,
    tcp_open,
)

log = logging.getLogger(__name__)


def build_supervisor(s: KvStoreSettings) -> Supervisor:
    log_dir = Path(s.state_dir) / "logs"
    master_cmd = master_command(s, find_binary("mooncake_master"))
    client_cmd = client_command(s, find_binary("mooncake_client"))

    async def master_ready() -> bool:
        return (
            tcp_open(s.host, s.master_port)
            and await http_ok(s.metadata_url + "?key=tandem-probe")
            and await http_ok(f"http://{s.host}:{s.master_metrics_port}/metrics")
        )

    async def client_ready() -> bool:
        return await http_ok(f"http://{s.host}:{s.client_http_port}/health", expect="healthy")

    async def segment_dropped() -> bool:
        # Engines mount no memory: the pool owner's segment is all the RAM
        # the master knows, and it drops it --client-ttl-s after the last
        # heartbeat.
        text = await http_text(f"http://{s.host}:{s.master_metrics_port}/metrics")
        return (
            text is not None and parse_master_metrics(text).get("master_total_capacity_bytes") == 0
        )

    return Supervisor(
        ManagedProcess(master_cmd, master_ready, log_dir, s.start_timeout_s, s.restart_backoff_s),
        ManagedProcess(client_cmd, client_ready, log_dir, s.start_timeout_s, s.restart_backoff_s),
        segment_dropped,
        segment_timeout_s=s.client_ttl_s + 5.0,
    )


def write_engine_config(s: KvStoreSettings) -> str:
    path = s.engine_config_path
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(engine_store_config(s), f, indent=2)
    os.replace(tmp, path)
    return path


def build_app(s: KvStoreSettings, supervisor: Supervisor) -> FastAPI:
    app = FastAPI(title="tandem-kvstore", docs_url=None, redoc_url=None)
    master_metrics_url = f"http://{s.host}:{s.master_metrics_port}/metrics"

    def fetch_master() -> str | None:
        try:
            resp = httpx.get(master_metrics_url, timeout=2.0)
            return resp.text if resp.status_code == 200 else None
        except httpx.HTTPError:
            return None

    registry = CollectorRegistry()
    registry.register(StoreCollector(fetch_master, supervisor.statuses))

    @app.get("/health")
    def health() -> JSONResponse:
        procs = {
            name: {"ready": st.ready, "pid": st.pid, "restarts": st.restarts}
            for name, st in supervisor.statuses().items()
        }
        ok = supervisor.ready
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "processes": procs},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    def metrics() -> Response:  # sync: runs in the thread pool (blocking scrape)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/engine-config")
    def engine_config() -> JSONResponse:
        return JSONResponse({"path": s.engine_config_path, "config": engine_store_config(s)})

    return app


async def serve(s: KvStoreSettings) -> int:
    supervisor = build_supervisor(s)
    try:
        await supervisor.start()
    except StartupError as exc:
        log.error("store did not start: %s", exc)
        return 1
    path = write_engine_config(s)
    log.info(
        "kv store ready: master=%s metadata=%s pool=%s disk=%s retention=%s; "
        "engines: MOONCAKE_CONFIG_PATH=%s",
        s.master_address,
        s.metadata_url,
        s.pool_size,
        s.disk_path if s.enable_disk else "off",
        s.retention,
        path,
    )

    config = uvicorn.Config(
        build_app(s, supervisor),
        host=s.host,
        port=s.http_port,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # we own SIGTERM handling
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(server.serve())
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if http_task in done and not stop.is_set():
        log.error("--http-port %d: HTTP server stopped unexpectedly", s.http_port)
        code = 1
    log.info("shutting down: stopping pool owner and master")
    server.should_exit = True
    await supervisor.shutdown()
    await asyncio.gather(http_task, return_exceptions=True)
    stop_task.cancel()
    log.info("kv store stopped")
    return code


def main(argv: list[str] | None = None) -> int:
    setup_logging("kvstore")
    try:
        settings = parse_settings(sys.argv[1:] if argv is None else argv)
        validate(settings)
        find_binary("mooncake_master")
        find_binary("mooncake_client")
    except (SettingError, FileNotFoundError) as exc:
        log.error("bad configuration: %s", exc)
        print(f"tandem-kvstore: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(settings))
